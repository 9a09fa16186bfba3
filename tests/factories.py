"""factory_boy factories for the tenant tree."""

import factory

from kestrel_one.accounts.models import User
from kestrel_one.audit.models import AuditChain
from kestrel_one.tenancy.models import Environment, Membership, Organization, Project


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"person{n}@example.com")
    name = factory.Faker("name")
    password = factory.django.Password("correct horse battery staple")


class OrganizationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Organization
        skip_postgeneration_save = True

    slug = factory.Sequence(lambda n: f"org-{n}")
    name = factory.LazyAttribute(lambda o: f"Organization {o.slug}")
    audit_chain = factory.RelatedFactory(
        "tests.factories.AuditChainFactory", factory_related_name="organization"
    )


class AuditChainFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = AuditChain


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    organization = factory.SubFactory(OrganizationFactory)
    user = factory.SubFactory(UserFactory)
    role = "member"


class EnvironmentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Environment

    organization = factory.SubFactory(OrganizationFactory)
    name = factory.Sequence(lambda n: f"env-{n}")


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project

    organization = factory.SubFactory(OrganizationFactory)
    environment = factory.SubFactory(
        EnvironmentFactory, organization=factory.SelfAttribute("..organization")
    )
    name = factory.Sequence(lambda n: f"project-{n}")
