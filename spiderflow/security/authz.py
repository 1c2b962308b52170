"""Authorisation rules of the job API and the planner (pure; the principal is passed in).

``None`` as the principal means the server does not authenticate (development mode): everything is
allowed. Otherwise (roles: :class:`~spiderflow.security.identity.Role`):

Roles are not interchangeable: a service certificate is not an operator's. The job API is for tenants,
the agents (their own reports) and the admin; no service acts on it (the scheduler's own replicas read
etcd, and the planner and topology services never call it), so a stolen planner or topology certificate
cannot list, submit or cancel anything.

- **Submit**: tenants submit for themselves: an unset tenant in the job (empty, or the placeholder
  ``default`` that job files and the SDK fill in) becomes the caller's; another tenant's name is
  PERMISSION_DENIED. Admins submit for any tenant; agents and services may not submit.
- **See / watch / cancel a job**: tenants only their own jobs; a job of another tenant is reported as
  NOT_FOUND, exactly like a job that does not exist, so tenants cannot probe each other's job ids.
  Agents may see (not cancel) the jobs whose plan has a stage on their cluster. Admins: all; services:
  none (NOT_FOUND).
- **List jobs**: tenants see only their own (asking for another tenant is PERMISSION_DENIED); agents and
  services may not list; admins list all.
- **Report progress**: only an agent, only for its own cluster, only for a job whose plan has a stage on
  that cluster (PERMISSION_DENIED otherwise).
- **Plan / Estimate** (planner): the scheduler service (:data:`PLANNER_CLIENTS`) and admins for any job;
  tenants only for their own tenant's jobs; agents and the other services are PERMISSION_DENIED.
"""

from __future__ import annotations

from collections.abc import Iterable

from spiderflow.core.errors import NotFoundError, PermissionDeniedError
from spiderflow.security.identity import Principal, Role

PLANNER_CLIENTS = frozenset({"scheduler"})
"""Services that call the planner on behalf of any tenant (the scheduler's final plans)."""
UNSET_TENANTS = frozenset({"", "default"})
"""Tenant values that mean "not given" (``default`` is :class:`~spiderflow.core.domain.JobSpec`'s default)."""

__all__ = [
    "PLANNER_CLIENTS",
    "UNSET_TENANTS",
    "authorize_list",
    "authorize_plan",
    "authorize_report",
    "can_see",
    "require_visible",
    "submit_tenant",
]


def submit_tenant(principal: Principal | None, requested: str) -> str:
    """The tenant a submission is recorded under (``requested`` empty = not given); raises
    PermissionDeniedError."""
    if principal is None or principal.role is Role.ADMIN:
        return requested
    if principal.role is not Role.TENANT:
        raise PermissionDeniedError(f"{principal} may not submit jobs")
    if requested not in UNSET_TENANTS and requested != principal.name:
        raise PermissionDeniedError(f"{principal} may not submit jobs for tenant {requested!r}")
    return principal.name


def can_see(principal: Principal | None, tenant: str, clusters: Iterable[str]) -> bool:
    """Whether the caller may read a job of ``tenant`` whose plan runs on ``clusters``."""
    if principal is None or principal.role is Role.ADMIN:
        return True
    if principal.role is Role.TENANT:
        return tenant == principal.name
    if principal.role is Role.AGENT:
        return principal.name in set(clusters)
    return False


def require_visible(principal: Principal | None, job_id: str, tenant: str, clusters: Iterable[str], *,
                    write: bool = False) -> None:
    """NOT_FOUND (as for a missing job) unless the caller may see the job; for ``write`` (cancel), agents
    that may see it get PERMISSION_DENIED."""
    if not can_see(principal, tenant, clusters):
        raise NotFoundError(f"job {job_id!r} not found")
    if write and principal is not None and principal.role is Role.AGENT:
        raise PermissionDeniedError(f"{principal} may not cancel jobs")


def authorize_list(principal: Principal | None, requested_tenant: str) -> str:
    """The tenant filter a ListJobs call is answered with ("" = all tenants)."""
    if principal is None or principal.role is Role.ADMIN:
        return requested_tenant
    if principal.role is not Role.TENANT:
        raise PermissionDeniedError(f"{principal} may not list jobs")
    if requested_tenant and requested_tenant != principal.name:
        raise PermissionDeniedError(f"{principal} may not list the jobs of tenant {requested_tenant!r}")
    return principal.name


def authorize_report(principal: Principal | None, claimed_cluster: str, job_id: str,
                     clusters: Iterable[str]) -> str:
    """The cluster a progress report is recorded for; raises PermissionDeniedError unless the caller is
    the agent of a cluster that runs a stage of the job."""
    if principal is None:
        return claimed_cluster
    if principal.role is not Role.AGENT:
        raise PermissionDeniedError(f"{principal} is not an agent; only agents report progress")
    if claimed_cluster and claimed_cluster != principal.name:
        raise PermissionDeniedError(f"{principal} may not report for cluster {claimed_cluster!r}")
    if principal.name not in set(clusters):
        raise PermissionDeniedError(f"cluster {principal.name!r} runs no stage of job {job_id}")
    return principal.name


def authorize_plan(principal: Principal | None, job_tenant: str) -> None:
    """Raise PermissionDeniedError unless the caller may plan a job of ``job_tenant`` (see
    :data:`UNSET_TENANTS`)."""
    if principal is None or principal.role is Role.ADMIN or \
            (principal.role is Role.SERVICE and principal.name in PLANNER_CLIENTS):
        return
    if principal.role is not Role.TENANT:
        raise PermissionDeniedError(f"{principal} may not call the planner")
    if job_tenant not in UNSET_TENANTS and job_tenant != principal.name:
        raise PermissionDeniedError(f"{principal} may not plan jobs of tenant {job_tenant!r}")
