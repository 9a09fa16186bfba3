from django.apps import AppConfig


class CredentialsConfig(AppConfig):
    name = "kestrel_one.credentials"
    label = "credentials"

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from kestrel_one.credentials.services import connections_end_for_member
        from kestrel_one.tenancy.models import Membership

        def membership_ended(sender, instance, **kwargs):
            # Whoever removes the membership (the person, an admin, a cascade), the person's
            # connections there stop working with it (TEN-5).
            connections_end_for_member(
                organization_id=instance.organization_id, user_id=instance.user_id
            )

        post_delete.connect(
            membership_ended,
            sender=Membership,
            weak=False,
            dispatch_uid="credentials.membership_ended",
        )
