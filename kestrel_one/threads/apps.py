from django.apps import AppConfig


class ThreadsConfig(AppConfig):
    name = "kestrel_one.threads"
    label = "threads"
