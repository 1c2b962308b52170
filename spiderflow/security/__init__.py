"""Security: identities, a development CA, mTLS credentials, authentication, authorisation, rate limits.

- :mod:`~spiderflow.security.identity` — principals (``tenant:alice``, ``agent:virginia``, ...) and the
  principal of the call being served;
- :mod:`~spiderflow.security.certs` — ``spiderflow certs init``: CA and per-component bundles;
- :mod:`~spiderflow.security.tls` — gRPC credentials from a bundle, the ``--tls-dir``/``--insecure``/
  ``--tokens`` flags of every service;
- :mod:`~spiderflow.security.auth` — bearer tokens, certificate identities, the server interceptor;
- :mod:`~spiderflow.security.authz` — who may do what on the job API and the planner;
- :mod:`~spiderflow.security.ratelimit` — per-client token buckets.
"""
