"""The codec: property-based round trips of real messages, a wire any msgpack
library reads and writes, tensors as raw frames, and clear decode errors."""

from __future__ import annotations

from typing import Any, ClassVar

import msgpack
import msgspec
import numpy as np
import pytest
from actorlm.messages.base import Message
from actorlm.messages.control import ErrorReply, PeerDown, Ping, Ready, Shutdown, Stats
from actorlm.messages.envelope import Codec, DecodeError, Envelope, Kind, MessageTooLarge
from actorlm.messages.errors import CallErrorCode, ErrorCode
from actorlm.messages.generate import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    TextBatch,
    TextDelta,
    TokenBatch,
    TokenDelta,
    TokenLogprob,
    Usage,
)
from actorlm.messages.sampling import LogitProcessorSpec, SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqResult, SeqStep, StepResult, TopLogprob
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


class Tensors(Message, frozen=True, kw_only=True):
    """A message carrying arrays, as a worker's KV transfer would."""

    TAG: ClassVar[str] = "test.tensors"
    name: str
    arrays: list[np.ndarray]
    extra: np.ndarray | None = None


# -- strategies ---------------------------------------------------------------
ints = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 2**31 - 1)
floats = st.floats(allow_nan=False, width=64)
text = st.text(max_size=20)
token_ids = st.lists(small, max_size=12)
json_leaf = st.none() | st.booleans() | ints | floats | text
json = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
json_dict = st.dictionaries(text, json, max_size=4)

sampling = st.builds(
    SamplingParams,
    max_new_tokens=small,
    temperature=floats,
    top_k=ints,
    logit_bias=st.dictionaries(small, floats, max_size=3),
    seed=st.none() | ints,
    stop=st.lists(text, max_size=3),
    logit_processors=st.lists(
        st.builds(LogitProcessorSpec, name=text, params=json_dict), max_size=2
    ),
)
chat = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant"]),
    content=st.none() | text | st.lists(json_dict, max_size=2),
    name=st.none() | text,
)
generate = st.builds(
    GenerateRequest,
    rid=text,
    text=st.none() | text,
    messages=st.none() | st.lists(chat, max_size=3),
    input_ids=st.none() | token_ids,
    sampling=sampling,
    priority=ints,
    chat_template_kwargs=json_dict,
)
seq_step = st.builds(
    SeqStep,
    text,
    token_ids,
    small,
    token_ids,
    st.booleans(),
    st.none() | st.builds(SeqInit, sampling=sampling, token_ids=token_ids, prompt_len=small),
)
forward = st.builds(
    ForwardBatch,
    step_id=small,
    seqs=st.lists(seq_step, max_size=4),
    release=st.lists(text, max_size=3),
)
top = st.lists(st.builds(TopLogprob, small, floats), max_size=3)
step_result = st.builds(
    StepResult,
    step_id=small,
    results=st.lists(
        st.builds(SeqResult, text, small, st.none() | floats, st.none() | top), max_size=4
    ),
    forward_ms=floats,
)
token_batch = st.builds(
    TokenBatch,
    items=st.lists(
        st.builds(
            TokenDelta,
            rid=text,
            token_ids=token_ids,
            logprobs=st.none() | st.lists(floats, max_size=3),
            top_logprobs=st.none() | st.lists(top, max_size=2),
            error_code=st.none() | st.sampled_from(ErrorCode),
        ),
        max_size=3,
    ),
)
text_batch = st.builds(
    TextBatch,
    items=st.lists(
        st.builds(
            TextDelta,
            rid=text,
            text=text,
            token_ids=token_ids,
            logprobs=st.none()
            | st.lists(
                st.builds(
                    TokenLogprob,
                    text,
                    small,
                    floats,
                    st.lists(st.tuples(text, small, floats), max_size=2),
                ),
                max_size=2,
            ),
            finish_reason=st.none() | st.sampled_from(list(FinishReason)),
            matched_stop=st.none() | text | small,
            usage=st.none() | st.builds(Usage, small, small, small),
        ),
        max_size=3,
    ),
)
control = st.one_of(
    st.builds(Ready, role=text, pid=small, address=text, info=json_dict),
    st.builds(PeerDown, role=text, reason=text),
    st.builds(Ping, payload=st.binary(max_size=64)),
    st.builds(Shutdown, reason=text),
    st.builds(Stats, role=text, values=json_dict),
    st.builds(ErrorReply, code=st.sampled_from(CallErrorCode), message=text, status=small),
)
messages = st.one_of(generate, forward, step_result, token_batch, text_batch, control)
envelopes = st.builds(
    Envelope,
    st.just(""),
    ints,
    text,
    st.sampled_from(list(Kind)).map(int),
    ints,
    text,
    ints,
    ints,
)


def _lists(value: Any) -> Any:
    """msgpack has one array type: tuples come back as lists."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def frames_for(
    msg: Message, env: Envelope | None = None, codec: Codec | None = None
) -> list[bytes]:
    env = msgspec.structs.replace(env or Envelope("", 1, "test"), tag=msg.TAG)
    return [bytes(f) for f in (codec or Codec()).encode(env, msg)]


# -- round trips ----------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(msg=messages, env=envelopes)
def test_real_messages_round_trip(msg: Message, env: Envelope) -> None:
    frames = frames_for(msg, env)
    assert len(frames) == 2
    got_env, got = Codec().decode(frames)
    assert got == msg and type(got) is type(msg)
    assert got_env == msgspec.structs.replace(env, tag=msg.TAG)


@settings(max_examples=80, deadline=None)
@given(msg=messages)
def test_the_wire_is_plain_msgpack(msg: Message) -> None:
    env_frame, body = frames_for(
        msg, Envelope("", 7, "gateway", Kind.REQUEST, 3, "ipc:///tmp/gw.sock", 11, 12)
    )
    assert msgpack.unpackb(env_frame) == [
        msg.TAG,
        7,
        "gateway",
        Kind.REQUEST,
        3,
        "ipc:///tmp/gw.sock",
        11,  # the sender's incarnation
        12,  # the receiver's, as the sender knows it
    ]
    expected = _lists(msgspec.to_builtins(msg, builtin_types=(bytes,)))
    assert msgpack.unpackb(body, strict_map_key=False) == expected


def test_msgpack_reads_named_fields() -> None:
    msg = GenerateRequest(
        rid="r1",
        messages=[ChatMessage(role="user", content="hi")],
        sampling=SamplingParams(temperature=0.5, stop=["\n"]),
    )
    body = msgpack.unpackb(frames_for(msg)[1])
    assert body["rid"] == "r1" and body["text"] is None
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # omit_defaults drops name
    assert body["sampling"]["temperature"] == 0.5 and body["sampling"]["stop"] == ["\n"]
    step = ForwardBatch(step_id=4, seqs=[SeqStep("r1", [1, 2], 0, [9])])
    assert msgpack.unpackb(frames_for(step)[1])["seqs"] == [
        ["r1", [1, 2], 0, [9], True, None, None]
    ]


def test_finish_reasons_travel_as_their_plain_strings() -> None:
    typed = TokenBatch(items=[TokenDelta(rid="r1", finish_reason=FinishReason.LENGTH)])
    plain = TokenBatch(items=[TokenDelta(rid="r1", finish_reason="length")])  # type: ignore[arg-type]
    assert frames_for(typed) == frames_for(plain)
    assert msgpack.unpackb(frames_for(typed)[1])["items"][0][4] == "length"
    got = Codec().decode(frames_for(typed))[1]
    assert isinstance(got, TokenBatch)
    assert got.items[0].finish_reason is FinishReason.LENGTH


def test_call_error_codes_travel_as_their_plain_strings() -> None:
    typed = ErrorReply(code=CallErrorCode.STALE_INCARNATION, message="m", status=503)
    plain = ErrorReply(code="stale_incarnation", message="m", status=503)  # type: ignore[arg-type]
    assert frames_for(typed) == frames_for(plain)
    assert msgpack.unpackb(frames_for(typed)[1])["code"] == "stale_incarnation"
    got = Codec().decode(frames_for(plain))[1]
    assert isinstance(got, ErrorReply) and got.code is CallErrorCode.STALE_INCARNATION
    with pytest.raises(DecodeError, match="code"):  # a code outside the enum is no reply
        Codec().decode(frames_for(msgspec.structs.replace(plain, code="made_up")))  # type: ignore[arg-type]


dtypes = st.sampled_from(
    [np.float32, np.float16, np.int64, np.int32, np.uint8, np.bool_, np.float64]
)


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.lists(
        dtypes.flatmap(
            lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=8))
        ),
        min_size=0,
        max_size=3,
    ),
    extra=st.none() | hnp.arrays(np.float32, st.just((4, 4)), elements=st.floats(-1, 1, width=32)),
)
def test_arrays_travel_as_raw_frames(arrays: list[np.ndarray], extra: np.ndarray | None) -> None:
    msg = Tensors(name="kv", arrays=arrays, extra=extra)
    frames = frames_for(msg)
    every = [*arrays, *([] if extra is None else [extra])]
    assert len(frames) == 2 + len(every)
    for i, arr in enumerate(every):
        assert frames[2 + i] == arr.tobytes()
        if arr.nbytes >= 16:  # short byte strings could match by chance
            assert arr.tobytes() not in frames[1]
    body = msgpack.unpackb(frames[1])
    assert body["arrays"] == [
        {"__tensor__": i, "dtype": a.dtype.str, "shape": list(a.shape)}
        for i, a in enumerate(arrays)
    ]
    _, got = Codec().decode(frames)
    assert isinstance(got, Tensors) and len(got.arrays) == len(arrays)
    for a, b in zip([*got.arrays, got.extra], [*arrays, extra], strict=True):
        if b is None:
            assert a is None
        else:
            assert (
                a.dtype == b.dtype
                and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=b.dtype.kind == "f")
            )


def test_non_contiguous_arrays_are_sent_contiguous() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    _, got = Codec().decode(frames_for(Tensors(name="t", arrays=[base[:, ::2], base.T])))
    assert isinstance(got, Tensors)
    assert np.array_equal(got.arrays[0], base[:, ::2]) and np.array_equal(got.arrays[1], base.T)


# -- a producer that is not msgspec --------------------------------------------------
def test_frames_built_with_msgpack_alone_decode() -> None:
    codec = Codec()
    env = msgpack.packb(["gen.request", 11, "rust-gateway"])  # trailing envelope fields defaulted
    body = msgpack.packb(
        {"rid": "x", "messages": [{"role": "user", "content": "hello"}], "sampling": {"top_k": 5}}
    )
    got_env, got = codec.decode([env, body])
    assert got_env == Envelope("gen.request", 11, "rust-gateway", Kind.SEND)
    assert got == GenerateRequest(
        rid="x",
        messages=[ChatMessage(role="user", content="hello")],
        sampling=SamplingParams(top_k=5),
    )
    env = msgpack.packb(
        [
            "step.forward",
            12,
            "c-scheduler",
            int(Kind.REQUEST),
            0,
            "tcp://h:1",
            77,
        ]
    )
    body = msgpack.packb({"step_id": 1, "seqs": [["r", [5, 6], 0, [1]], ["s", [7], 3, [2], False]]})
    got_env, step = codec.decode([env, body])
    assert got_env.incarnation == 77 and got_env.kind == Kind.REQUEST
    assert step == ForwardBatch(
        step_id=1, seqs=[SeqStep("r", [5, 6], 0, [1]), SeqStep("s", [7], 3, [2], False)]
    )
    arr = np.arange(6, dtype="<f4").reshape(2, 3)
    body = msgpack.packb(
        {"name": "t", "arrays": [{"__tensor__": 0, "dtype": "<f4", "shape": [2, 3]}]}
    )
    _, tensors = codec.decode([msgpack.packb(["test.tensors", 1, "c"]), body, arr.tobytes()])
    assert isinstance(tensors, Tensors) and np.array_equal(tensors.arrays[0], arr)


# -- rejection -----------------------------------------------------------------
def raw(tag: str, body: Any, *extra: bytes) -> list[bytes]:
    return [msgpack.packb([tag, 1, "peer", 0, 0, "ipc:///peer"]), msgpack.packb(body), *extra]


def test_unknown_tag_is_rejected_with_its_envelope() -> None:
    with pytest.raises(DecodeError, match="unknown message tag 'no.such'") as info:
        Codec().decode(raw("no.such", {}))
    assert info.value.envelope is not None and info.value.envelope.sender == "peer"


@pytest.mark.parametrize(
    ("tag", "body", "names"),
    [
        ("ctl.ping", {"payload": 5}, ["ctl.ping", "bytes", "$.payload"]),
        (
            "gen.request",
            {"rid": "r", "sampling": {"temperature": "hot"}},
            ["float", "$.sampling.temperature"],
        ),
        (
            "step.forward",
            {"step_id": 1, "seqs": [["r", "not ids", 0, []]]},
            ["array", "$.seqs[0][1]"],
        ),
    ],
)
def test_wrong_field_type_names_the_field(tag: str, body: Any, names: list[str]) -> None:
    with pytest.raises(DecodeError) as info:
        Codec().decode(raw(tag, body))
    for name in names:
        assert name in str(info.value)
    assert f"invalid {tag!r} message" in str(info.value)


def test_missing_field_names_the_field() -> None:
    with pytest.raises(DecodeError, match="missing required field `reason`"):
        Codec().decode(raw("ctl.peer_down", {"role": "worker"}))


def test_oversized_message_is_rejected() -> None:
    codec = Codec(max_message_bytes=100)
    frames = frames_for(Ping(payload=b"x" * 200))
    with pytest.raises(MessageTooLarge, match="over the 100-byte limit") as info:
        codec.decode(frames)
    assert "ctl.ping" in str(info.value) and info.value.envelope is not None
    big = frames_for(Tensors(name="t", arrays=[np.zeros(64, np.float32)]))  # raw frames count too
    with pytest.raises(MessageTooLarge):
        codec.decode(big)
    assert Codec(max_message_bytes=400).decode(big)[1].TAG == "test.tensors"


def test_too_few_frames_and_bad_envelopes() -> None:
    codec = Codec()
    with pytest.raises(DecodeError, match="at least 2 frames"):
        codec.decode([msgpack.packb(["ctl.ping", 1, "p"])])
    with pytest.raises(DecodeError, match="bad envelope"):
        codec.decode([b"\xc1", b""])
    with pytest.raises(DecodeError, match="bad envelope") as info:
        codec.decode([msgpack.packb({"tag": "ctl.ping"}), msgpack.packb({})])
    assert info.value.envelope is None
    body = {"name": "t", "arrays": [{"__tensor__": 0, "dtype": "<f4", "shape": [2]}]}
    with pytest.raises(DecodeError, match="tensor frame 2 missing"):
        codec.decode(raw("test.tensors", body))
