"""Reading a policy draft against what is published: its diff, what it grants, where a project
draft widens its environment, which projects an environment draft would cap, and the answer
a call would get under it (explain).

The questions are answered by the same engine calls the publish path and the decision path
make (``widenings`` against ``environment_ceiling``, ``decide_call`` on a meet of the same
layers), so what the console shows before publishing is what publishing and deciding do.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

from kestrel_one.governance.judging import Judgement, call_judge, decide_effective
from kestrel_one.governance.models import PolicyDraft
from kestrel_one.governance.selectors import (
    EffectivePolicy,
    environment_ceiling,
    parse_surface,
    policy_of,
    surface_policy,
    surface_version_current,
    token_mask,
)
from kestrel_one.governance.services import draft_owner
from kestrel_one.tenancy.models import Environment, Project
from policies import (
    CAPABILITY_NAMES,
    READ_AND_NETWORK_CAPABILITIES,
    Mode,
    Policy,
    Request,
    Widening,
    meet_all,
    mode_mask,
    parse_policy_json,
    widenings,
)

# What a draft's effective policy records as its version in an explanation.
DRAFT = "draft"


def policy_draft_of(owner: Environment | Project) -> PolicyDraft | None:
    return PolicyDraft.objects.filter(**draft_owner(owner)).first()


def draft_policy(draft: PolicyDraft | None) -> Policy | None:
    """The draft as a policy, parsed from its text as written (it was valid when saved), so
    that widenings point at list positions as its author wrote them, as publishing does."""
    if draft is None:
        return None
    return parse_policy_json(draft.text, limits=None)


def pretty_document(document: dict | None) -> str:
    """The canonical pretty JSON that diffs are taken of: sorted keys, two-space indent."""
    if document is None:
        return ""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class DiffLine:
    """One line of a diff: ``add``, ``del``, ``same`` or ``hunk`` (an ``@@`` header)."""

    kind: str
    text: str


def policy_diff(published: dict | None, draft: dict | None, *, context: int = 3) -> list[DiffLine]:
    """A line diff of the canonical pretty JSON of ``published`` and ``draft``; empty when
    they grant the same (the same canonical document)."""
    before = pretty_document(published).splitlines()
    after = pretty_document(draft).splitlines()
    lines = []
    for text in difflib.unified_diff(before, after, lineterm="", n=context):
        if text.startswith(("---", "+++")):
            continue
        if text.startswith("@@"):
            lines.append(DiffLine("hunk", text))
        elif text.startswith("+"):
            lines.append(DiffLine("add", text))
        elif text.startswith("-"):
            lines.append(DiffLine("del", text))
        else:
            lines.append(DiffLine("same", text))
    return lines


def project_draft_widenings(project: Project, policy: Policy) -> list[Widening]:
    """Every place the project draft grants more than its environment: exactly what
    ``policy_publish_project`` refuses it for."""
    return widenings(policy, environment_ceiling(project.environment), parent_label="environment")


@dataclass(frozen=True)
class CappedProject:
    """A project whose own published policy grants more than an environment draft would."""

    project: Project
    widenings: list[Widening]


def projects_capped(projects, policy: Policy) -> tuple[list[CappedProject], list[Project]]:
    """Of ``projects`` (the environment's, as the person may see them, with their
    ``policy_version`` loaded): those whose own policy the environment ``policy`` would cap,
    with where, and those that inherit the environment's policy as it is."""
    capped, inheriting = [], []
    for project in projects:
        own = policy_of(project.policy_version)
        if own is None:
            inheriting.append(project)
            continue
        found = widenings(own, policy, parent_label="environment")
        if found:
            capped.append(CappedProject(project, found))
    return capped, inheriting


@dataclass(frozen=True)
class GrantView:
    """What one capability grants, for people: each field's values, its limits, its modes."""

    capability: str
    approval: str
    fields: list[tuple[str, list[str]]]
    limits: list[tuple[str, Any]]
    modes: str


_FIELD_LABELS = {
    "paths": "Paths",
    "commands": "Commands",
    "env": "Environment variables",
    "allow": "Hosts (origins)",
    "allow_ip_literals": "IP literals",
    "models": "Models",
}


def grants_view(policy: Policy | None) -> list[GrantView]:
    """Every capability ``policy`` grants, readable; capabilities it lacks are denied."""
    if policy is None:
        return []
    views = []
    for capability, grant in policy.grants.items():
        document = grant.to_document()
        fields: list[tuple[str, list[str]]] = []
        if capability == "shell.exec" and "commands" not in document:
            fields.append(("Commands", ["any program"]))
        for key, value in document.items():
            if key in ("approval", "limits"):
                continue
            if key == "servers":
                for server, tools in value.items():
                    entry = list(tools["tools"])
                    entry += [
                        f"{tool} (dangerous, opted in)" for tool in tools.get("dangerous", ())
                    ]
                    fields.append((f"MCP server {server}: tools", entry))
            elif key == "adapters":
                for adapter, spec in value.items():
                    fields.append((f"Adapter {adapter}: operations", list(spec["operations"])))
            elif isinstance(value, list):
                fields.append((_FIELD_LABELS.get(key, key), [str(item) for item in value]))
            else:
                fields.append((_FIELD_LABELS.get(key, key), [json.dumps(value)]))
        modes = (
            "every mode (ask, plan, agent, auto)"
            if capability in READ_AND_NETWORK_CAPABILITIES
            else "agent mode only (ask, plan and auto are read-only)"
        )
        views.append(
            GrantView(
                capability=capability,
                approval=document.get("approval", "never"),
                fields=fields,
                limits=list(document.get("limits", {}).items()),
                modes=modes,
            )
        )
    return views


def denied_capabilities(policy: Policy | None) -> list[str]:
    granted = policy.capabilities if policy is not None else frozenset()
    return sorted(CAPABILITY_NAMES - granted)


def draft_effective_policy(
    *,
    organization,
    principal,
    mode: Mode,
    environment_policy: Policy,
    project_policy: Policy | None,
    environment_version: str | None,
    project_version: str | None,
    surface: str = "api",
) -> EffectivePolicy:
    """Environment ∩ Project ∩ surface ∩ mode ∩ token scope with a draft in one layer: the
    meet ``effective_policy`` makes, of the layers given instead of the current versions (the
    surface's is the organization's current surface policy, as for a request)."""
    surface = parse_surface(surface)
    surface_version = surface_version_current(organization, surface)
    on_surface = surface_policy(surface_version)
    layers = (
        [environment_policy] if project_policy is None else [environment_policy, project_policy]
    )
    policy = meet_all(*layers, on_surface, mode_mask(mode), token_mask(principal, organization))
    return EffectivePolicy(
        policy=policy,
        mode=mode,
        surface=surface,
        environment_version=environment_version,
        project_version=project_version,
        surface_version=surface_version.public_id if surface_version else None,
        surface_policy=on_surface,
    )


@dataclass(frozen=True)
class Explanation:
    """One call judged under the published policy and under the draft."""

    published: Judgement
    draft: Judgement | None


def explain_published_and_draft(
    *,
    organization,
    principal,
    environment: Environment,
    project: Project | None,
    mode: Mode,
    policy_request: Request,
    canonical: dict,
    environment_draft: Policy | None = None,
    project_draft: Policy | None = None,
    surface: str = "api",
) -> Explanation:
    """Judge one call as ``explain`` does (``call_judge``) and as it would be under the
    draft, on ``surface`` (the console asks about its own); ``project`` None asks about a
    project of ``environment`` without a policy of its own."""
    if project is not None:
        published = call_judge(
            project=project,
            principal=principal,
            mode=mode,
            policy_request=policy_request,
            canonical=canonical,
            surface=surface,
        )
    else:
        published = _judge(
            organization=organization,
            principal=principal,
            mode=mode,
            environment_policy=environment_ceiling(environment),
            project_policy=None,
            environment_version=_public_id(environment.policy_version),
            project_version=None,
            policy_request=policy_request,
            canonical=canonical,
            surface=surface,
        )
    draft = None
    if environment_draft is not None or project_draft is not None:
        own = policy_of(project.policy_version) if project is not None else None
        draft = _judge(
            organization=organization,
            principal=principal,
            mode=mode,
            environment_policy=environment_draft or environment_ceiling(environment),
            project_policy=project_draft or own,
            environment_version=DRAFT
            if environment_draft is not None
            else _public_id(environment.policy_version),
            project_version=DRAFT
            if project_draft is not None
            else _public_id(project.policy_version if project is not None else None),
            policy_request=policy_request,
            canonical=canonical,
            surface=surface,
        )
    return Explanation(published=published, draft=draft)


def _public_id(version) -> str | None:
    return version.public_id if version is not None else None


def _judge(*, policy_request: Request, canonical: dict, **layers) -> Judgement:
    effective = draft_effective_policy(**layers)
    return Judgement(
        effective=effective, decision=decide_effective(effective, policy_request, canonical)
    )
