"""Engine replicas on Ray Serve behind one OpenAI-compatible app, routed by prefix.

``hyprefix serve --replicas N`` starts a local Ray cluster (or joins one with
``--ray-address``) and deploys ``app.build_replicas_app``: an ingress (the same FastAPI
app as the single-process server) and N engine replicas. The ingress computes each
request's block hashes (the engine's own: model identity and cache salt in the root)
and Ray Serve's ``router.PrefixAwareRequestRouter`` sends it to the replica holding
the longest usable prefix, balanced against load (``routing.policy``); replicas tell
the router what they hold through their KV cache events (``kv_events``).

Needs the ``replicas`` extra: ``pip install 'hyprefix[replicas]'``.
"""

from __future__ import annotations


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        import zmq  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"replicas need Ray Serve, pyzmq and msgpack ({exc}): pip install 'hyprefix[replicas]'") \
            from exc
