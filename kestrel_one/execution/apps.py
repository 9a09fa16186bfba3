from django.apps import AppConfig


class ExecutionConfig(AppConfig):
    name = "kestrel_one.execution"
    label = "execution"

    def ready(self) -> None:
        # Once the apps are loaded (the module reads models): registers thread_end_notice on
        # threads' thread_ended hook.
        from kestrel_one.execution import control  # noqa: F401
