"""The grammar of every id that becomes an etcd key or a file path, and tenant-qualified job ids.

Grammar (:data:`ID_PATTERN`): 1 to :data:`MAX_ID` characters of letters, digits, ``-``, ``_`` and ``.``,
the first not a ``.``. So ``.``, ``..``, ``/``, NUL, newlines, spaces and anything outside ASCII are
refused wherever an id is accepted (job ids, request ids, tenants, cluster names).

Job ids are namespaced per tenant. The id a tenant chooses (``train``) is *bare*; the job is stored under
its *qualified* id ``<tenant>~<bare>`` (:func:`qualify`), so two tenants may both have a job ``train``,
and a tenant can neither learn whether another tenant's id exists nor reach it: the qualified id names
the tenant, and a tenant's request for a qualified id of another tenant is answered exactly like a
missing job. The tenant ``default`` (jobs of a server that does not authenticate, and of job files
without a tenant) is not written into its ids: ``qualify("default", "j1") == "j1"``.

Pure: strings in, strings out, no I/O. Paths built from ids are checked by
:func:`spiderflow.security.ids.inside`.
"""

from __future__ import annotations

import re

from spiderflow.core.errors import ValidationError

__all__ = [
    "DEFAULT_TENANT",
    "ID_PATTERN",
    "MAX_ID",
    "MAX_TENANT",
    "SEP",
    "check_id",
    "check_job_id",
    "check_tenant",
    "qualify",
    "split_job_id",
]

MAX_ID = 128
"""Longest bare id (job, request, cluster)."""
MAX_TENANT = 63
"""Longest tenant name (the same bound as a principal's name)."""
SEP = "~"
"""Separator of a qualified job id (``<tenant>~<bare>``): outside the id grammar, so unambiguous."""
DEFAULT_TENANT = "default"
ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_SHOWN = 80


def _shown(value: object) -> object:
    """``value`` cut to a length that is safe to put in an error message."""
    if isinstance(value, str) and len(value) > _SHOWN:
        return value[:_SHOWN] + f"… ({len(value)} characters)"
    return value


def check_id(field: str, value: object, *, max_len: int = MAX_ID) -> str:
    """``value`` if it is an id of the grammar no longer than ``max_len``; ValidationError naming
    ``field`` otherwise."""
    if not isinstance(value, str) or not value or len(value) > max_len or not ID_PATTERN.fullmatch(value):
        raise ValidationError(field, f"must be 1–{max_len} characters of letters, digits, '-', '_' and '.', "
                              "not starting with '.'", _shown(value))
    return value


def check_tenant(field: str, value: object) -> str:
    """A tenant name (the id grammar, at most :data:`MAX_TENANT` characters)."""
    return check_id(field, value, max_len=MAX_TENANT)


def qualify(tenant: str, bare: str) -> str:
    """The stored id of tenant ``tenant``'s job ``bare`` (``bare`` itself for the default tenant)."""
    check_tenant("tenant", tenant)
    check_id("id", bare)
    return bare if tenant == DEFAULT_TENANT else f"{tenant}{SEP}{bare}"


def split_job_id(field: str, job_id: object) -> tuple[str, str]:
    """``(tenant, bare)`` of a stored job id (``("default", id)`` for an unqualified one); ValidationError
    naming ``field`` when it is neither a bare nor a qualified id of the grammar."""
    if not isinstance(job_id, str) or len(job_id) > MAX_TENANT + 1 + MAX_ID:
        raise ValidationError(field, f"must be at most {MAX_TENANT + 1 + MAX_ID} characters", _shown(job_id))
    tenant, sep, bare = job_id.partition(SEP)
    if not sep:
        return DEFAULT_TENANT, check_id(field, job_id)
    if tenant == DEFAULT_TENANT:
        raise ValidationError(field, f"the default tenant's job ids are not qualified (no '{SEP}')", job_id)
    return check_tenant(field, tenant), check_id(field, bare)


def check_job_id(field: str, job_id: object) -> str:
    """``job_id`` if it is a bare or a qualified job id (see :func:`split_job_id`)."""
    split_job_id(field, job_id)
    assert isinstance(job_id, str)
    return job_id
