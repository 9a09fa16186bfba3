"""Declarative permission checks: a principal must exist; org scopes come from a scope map."""

from __future__ import annotations

from rest_framework.permissions import BasePermission

from kestrel_one.accounts.principal import Principal


class IsPrincipal(BasePermission):
    """Every API route except health needs an authenticated principal (else 401)."""

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Principal)


class AllowAny(BasePermission):
    def has_permission(self, request, view) -> bool:
        return True
