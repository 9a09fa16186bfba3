"""People and the API tokens that act for them or for an integration."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, BaseUserManager, PermissionsMixin
from django.db import models
from django.utils import timezone

from kestrel_one.common.ids import PublicIdField


class UserManager(BaseUserManager):
    use_in_migrations = True

    def create_user(self, email: str, password: str | None = None, **fields):
        if not email:
            raise ValueError("a user needs an email address")
        user = self.model(email=self.normalize_email(email).lower(), **fields)
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        user.save(using=self._db)
        return user

    def create_superuser(self, email: str, password: str | None = None, **fields):
        fields.update(is_staff=True, is_superuser=True)
        return self.create_user(email, password, **fields)


class User(AbstractBaseUser, PermissionsMixin):
    """A person who signs in with an email address; organization roles live on Membership."""

    public_id = PublicIdField("usr")
    email = models.EmailField(unique=True)
    name = models.CharField(max_length=200, blank=True)
    is_active = models.BooleanField(default=True)
    is_staff = models.BooleanField(default=False, help_text="Can sign in to the operator admin.")
    date_joined = models.DateTimeField(default=timezone.now)

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    def __str__(self) -> str:
        return self.email


class ApiTokenQuerySet(models.QuerySet):
    def active(self, now=None):
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True, expires_at__gt=now)


AUDIENCE_API = ""
AUDIENCE_MCP = "mcp"
AUDIENCES = (AUDIENCE_API, AUDIENCE_MCP)


class ApiToken(models.Model):
    """A hashed API credential of one organization, for a person or for an integration."""

    public_id = PublicIdField("tok")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="tokens"
    )
    # Null for an integration token, which acts with exactly its scopes and is never a person.
    user = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.CASCADE, related_name="tokens"
    )
    created_by = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The token that minted this one (None: made from a console session or on the server).
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    # The public id of the root of the minting chain: a token minted by a token (or by an
    # OAuth client's refresh, in place of the one before) is the same agent, so it never
    # approves what its lineage requested. A root's lineage is its own id.
    lineage = models.CharField(max_length=40, db_index=True, editable=False)
    name = models.CharField(max_length=200)
    key_id = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    scopes = models.JSONField(default=list)
    # Integration tokens only (a person's token sees the person's projects): every project of
    # the organization, or exactly ``projects``. Neither: none (fail closed).
    all_projects = models.BooleanField(default=False)
    projects = models.ManyToManyField("tenancy.Project", blank=True, related_name="+")
    # A person's token only: set, it sees only ``projects`` among the person's own (a token an
    # MCP client got through OAuth for one project); unset, every project the person sees.
    limited_to_projects = models.BooleanField(default=False)
    # Where the token works: "" the whole API; AUDIENCE_MCP only the MCP endpoint (a token an
    # MCP client got through OAuth, for that endpoint's resource, RFC 8707), so a client
    # cannot take it to the REST API, which the mcp surface policy does not judge.
    audience = models.CharField(max_length=16, blank=True, default="", editable=False)
    # Integration tokens only: the named checks this token may record verifications as.
    checks = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["organization", "public_id"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix}…)"

    def save(self, *args, **kwargs):
        if not self.lineage:
            self.lineage = self.parent.lineage if self.parent_id else self.public_id
        super().save(*args, **kwargs)

    @property
    def is_integration(self) -> bool:
        return self.user_id is None

    @property
    def display_prefix(self) -> str:
        """The non-secret start of the token, enough for a person to recognise it."""
        return f"kst_{self.key_id}"
