from django.apps import AppConfig


class ExecutionConfig(AppConfig):
    name = "kestrel_one.execution"
    label = "execution"
