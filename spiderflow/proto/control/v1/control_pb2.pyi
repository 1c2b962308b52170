from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_PUT: _ClassVar[EventType]
    EVENT_TYPE_DELETE: _ClassVar[EventType]
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_PUT: EventType
EVENT_TYPE_DELETE: EventType

class KeyValue(_message.Message):
    __slots__ = ("key", "value", "create_revision", "mod_revision", "version", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., create_revision: _Optional[int] = ..., mod_revision: _Optional[int] = ..., version: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("cluster", "key")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    key: str
    def __init__(self, cluster: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValue
    def __init__(self, kv: _Optional[_Union[KeyValue, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("cluster", "prefix")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    prefix: str
    def __init__(self, cluster: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("kvs", "revision")
    KVS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    kvs: _containers.RepeatedCompositeFieldContainer[KeyValue]
    revision: int
    def __init__(self, kvs: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class RevisionRequest(_message.Message):
    __slots__ = ("cluster",)
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    def __init__(self, cluster: _Optional[str] = ...) -> None: ...

class RevisionResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("cluster", "key", "value", "lease", "compare", "expected_mod_revision")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    COMPARE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    key: str
    value: bytes
    lease: int
    compare: bool
    expected_mod_revision: int
    def __init__(self, cluster: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., lease: _Optional[int] = ..., compare: _Optional[bool] = ..., expected_mod_revision: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("succeeded", "revision", "current_mod_revision")
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    succeeded: bool
    revision: int
    current_mod_revision: int
    def __init__(self, succeeded: _Optional[bool] = ..., revision: _Optional[int] = ..., current_mod_revision: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("cluster", "key")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    key: str
    def __init__(self, cluster: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("cluster", "prefix", "start_revision")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    prefix: str
    start_revision: int
    def __init__(self, cluster: _Optional[str] = ..., prefix: _Optional[str] = ..., start_revision: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("type", "key", "value", "mod_revision", "create_revision", "lease")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    type: EventType
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int
    def __init__(self, type: _Optional[_Union[EventType, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., mod_revision: _Optional[int] = ..., create_revision: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("events", "compact_revision")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_REVISION_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[WatchEvent]
    compact_revision: int
    def __init__(self, events: _Optional[_Iterable[_Union[WatchEvent, _Mapping]]] = ..., compact_revision: _Optional[int] = ...) -> None: ...

class GrantLeaseRequest(_message.Message):
    __slots__ = ("cluster", "ttl")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    ttl: int
    def __init__(self, cluster: _Optional[str] = ..., ttl: _Optional[int] = ...) -> None: ...

class GrantLeaseResponse(_message.Message):
    __slots__ = ("lease", "ttl")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    lease: int
    ttl: int
    def __init__(self, lease: _Optional[int] = ..., ttl: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("cluster", "lease")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    lease: int
    def __init__(self, cluster: _Optional[str] = ..., lease: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl",)
    TTL_FIELD_NUMBER: _ClassVar[int]
    ttl: int
    def __init__(self, ttl: _Optional[int] = ...) -> None: ...

class RevokeLeaseRequest(_message.Message):
    __slots__ = ("cluster", "lease")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    lease: int
    def __init__(self, cluster: _Optional[str] = ..., lease: _Optional[int] = ...) -> None: ...

class RevokeLeaseResponse(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    def __init__(self, revoked: _Optional[bool] = ...) -> None: ...
