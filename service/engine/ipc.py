"""The wire between an engine core process (ddserve.engine.core) and its client
(ddserve.backends.core): two ZeroMQ PUSH/PULL sockets over Unix-domain `ipc://` paths, each
message one msgpack array. Token ids travel, never text; the core sends the outputs of all
its requests once per scheduler iteration.

client -> core
    [ADD, rid, prompt_ids, sampling]            sampling: SamplingParams as a map
                                                (logit_bias: [[token_id, bias], ...])
    [ABORT, rid]                                the client stopped reading: free the slot
    [CALL, call_id, method, args]               "update_params" (args: the changes), "info"
core -> client
    [READY, info]                               loaded, warmed up, a real generation done
    [FAILED, error_class, message, param]       start-up failed (then the core exits);
                                                the class is one of ddserve.errors
    [OUTPUTS, fingerprint, entries, load]       once per iteration; entries:
        [rid, new_ids, finish_reason|nil, stats|nil, error|nil, logprobs|nil]
        stats (a map of RequestStats) with the finish; error = [status, openai_error_body];
        logprobs (only for a request whose sampling asks) = [chosen, top_ids, top_logprobs]:
        the raw log-prob of each of new_ids, and per id the k best [ids], [log-probs]
        (ddserve.engine.sampling.Logprobs, one entry per new id)
    [REPLY, call_id, status, payload]           payload: the result, or an error body

Why ZeroMQ + msgpack (what vLLM's API server <-> EngineCore uses): framing, reconnects and
unbounded queues come with the library, and both sides wait on it without a thread of
their own (zmq.asyncio in the API's event loop). `python -m ddserve.bench.ipc_channel`
measures it against a plain Unix socket carrying the same messages.
"""

from __future__ import annotations

import dataclasses

import msgpack

from ddserve import errors
from ddserve.engine.sampling import RequestStats, SamplingParams

ADD, ABORT, CALL = 1, 2, 3
READY, FAILED, OUTPUTS, REPLY = 11, 12, 13, 14

# the core's config travels in this variable (JSON of EngineConfig: never on argv)
CONFIG_ENV = "DDSERVE_CORE_CONFIG"
# and the pid of the process that started it (the core exits once that one is gone)
PARENT_ENV = "DDSERVE_CORE_PARENT"


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def sampling_to_wire(sp: SamplingParams) -> dict:
    d = dataclasses.asdict(sp)
    d["stop"], d["stop_token_ids"] = list(sp.stop), list(sp.stop_token_ids)
    d["logit_bias"] = [list(p) for p in sp.logit_bias]
    return d


def sampling_from_wire(d: dict) -> SamplingParams:
    d = dict(d)
    d["stop"], d["stop_token_ids"] = tuple(d.get("stop", ())), tuple(d.get("stop_token_ids", ()))
    d["logit_bias"] = tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))
    return SamplingParams(**d)


def stats_to_wire(st: RequestStats) -> dict:
    return dataclasses.asdict(st)


def stats_from_wire(d: dict) -> RequestStats:
    return RequestStats(**d)


def error_to_wire(exc: BaseException) -> list:
    """[class name, message, param]: a start-up error crosses as what it is (a ConfigError
    stays a ConfigError: exit code 2, not an engine failure)."""
    if isinstance(exc, errors.DDServeError):
        return [type(exc).__name__, exc.message, exc.param]
    return ["EngineError", f"engine core failed: {type(exc).__name__}: {exc}", None]


def error_from_wire(name: str, message: str, param: str | None) -> errors.DDServeError:
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DDServeError)):
        cls = errors.EngineError
    return cls(message, param=param)
