from django.apps import AppConfig


class ExecutionConfig(AppConfig):
    name = "kestrel_one.execution"
    label = "execution"

    def ready(self) -> None:
        # Registers thread_end_notice on threads' thread_ended hook.
        from kestrel_one.execution import control  # noqa: F401
