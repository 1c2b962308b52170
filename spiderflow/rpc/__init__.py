"""gRPC plumbing shared by every service: domain <-> proto converters (:mod:`.convert`), the domain
error <-> status code mapping (:mod:`.errors`) and the server/channel builders (:mod:`.server`)."""

__all__ = ["convert", "errors", "grpcurl", "server"]
