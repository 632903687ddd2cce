"""The wire between an engine core process (ddserve.engine.core) and its client
(ddserve.backends.core): two ZeroMQ PUSH/PULL sockets over Unix-domain `ipc://` paths, each
message one msgpack array. Token ids travel, never text; the core sends the outputs of all
its requests once per scheduler iteration.

client -> core
    [ADD, rid, prompt_ids, sampling]            sampling: SamplingParams as a map
                                                (logit_bias: [[token_id, bias], ...])
    [ABORT, rid]                                the client stopped reading: free the slot
    [CALL, call_id, method, args]               "update_params" (args: the changes), "info"
    [HELLO, client]                             a client that joined after start-up asks for
                                                READY on its own socket
    [ACK, call_id, client]                      this client applied a PARAMS broadcast
core -> client
    [READY, info]                               loaded, warmed up, a real generation done
    [PARAMS, call_id, info]                     another client changed the live parameters:
                                                apply `info` before anything later (ACK it)
    [FAILED, error_class, message, param]       start-up failed (then the core exits);
                                                the class is one of ddserve.errors
    [OUTPUTS, fingerprint, entries, load]       once per iteration; entries:
        [rid, new_ids, finish_reason|nil, stats|nil, error|nil, logprobs|nil]
        stats (a map of RequestStats) with the finish; error = [status, openai_error_body];
        logprobs (only for a request whose sampling asks) = [chosen, top_ids, top_logprobs]:
        the raw log-prob of each of new_ids, and per id the k best [ids], [log-probs]
        (ddserve.engine.sampling.Logprobs, one entry per new id)
    [REPLY, call_id, status, payload]           payload: the result, or an error body

Several clients (`ddserve engine --api-server-count N`: N API processes over one core, as
vLLM's API servers over its EngineCore): the core reads one PULL socket all clients push to,
and keeps a PUSH socket per client (`out_address(OUT_ADDR, i)`). Client i numbers its
requests and calls i, i + N, i + 2N, ... (`client_of(id, N) == i`), so the core routes every
output and reply without a field of its own. A parameter change answers its caller only
once every other client has applied it (PARAMS, then ACK): after /admin/params returns, no API
process resolves a request with the old defaults.

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

ADD, ABORT, CALL, HELLO, ACK = 1, 2, 3, 4, 5
READY, FAILED, OUTPUTS, REPLY, PARAMS = 11, 12, 13, 14, 15

# the core's config travels in this variable (JSON of EngineConfig: never on argv)
CONFIG_ENV = "DDSERVE_CORE_CONFIG"
# and the pid of the process that started it (the core exits once that one is gone)
PARENT_ENV = "DDSERVE_CORE_PARENT"


def out_address(out_addr: str, client: int) -> str:
    """Where client `client` reads its outputs: OUT_ADDR itself for client 0 (the only one
    when there is one), OUT_ADDR-i for the others."""
    return out_addr if client == 0 else f"{out_addr}-{client}"


def client_of(ident: int, clients: int) -> int:
    """The client a request id or call id belongs to (ids are numbered per client, above)."""
    return ident % clients


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
