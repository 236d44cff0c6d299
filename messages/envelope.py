"""The envelope and the codec: how a message becomes ZMQ frames and back.

Frames: ``[envelope, body, *tensor_frames]``. Envelope and body are plain
msgpack (the envelope an array, the body a map of the struct's fields), so any
msgpack library can read them. ``numpy.ndarray`` fields travel as extra raw
frames; in the body they appear as ``{"__tensor__": i, "dtype": ..., "shape": [...]}``
pointing at frame ``2 + i``. Their bytes are never copied into msgpack.

Decoding validates: unknown tags, wrong field types and oversized messages raise
:class:`DecodeError` with a message that names the problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgspec
import numpy as np

from .base import Message, type_for_tag

__all__ = ["Codec", "DecodeError", "Envelope", "Kind", "MessageTooLarge"]


class Kind(IntEnum):
    SEND = 0  # fire and forget
    REQUEST = 1  # expects one REPLY (or ERROR)
    REPLY = 2
    STREAM = 3  # one item of a streamed reply
    END = 4  # the stream is over
    ERROR = 5  # body is an ErrorReply


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    tag: str
    id: int
    sender: str
    kind: int = Kind.SEND
    reply_to: int = 0  # the id of the request this answers
    reply_addr: str = ""  # where the sender receives (lets actors outside the book join)
    incarnation: int = 0  # the sender's: a fresh id each time an actor starts
    to_incarnation: int = 0  # the receiver's, as the sender knows it (0: any)


class DecodeError(ValueError):
    """A frame set that is not a valid message. ``envelope`` is set when the
    envelope itself decoded, so the receiver can tell the sender what was wrong."""

    def __init__(self, message: str, envelope: Envelope | None = None) -> None:
        super().__init__(message)
        self.envelope = envelope


class MessageTooLarge(DecodeError):
    pass


Frame = bytes | memoryview


class Codec:
    """Encoder/decoder pair; one per actor runtime (it is not thread-safe)."""

    def __init__(self, max_message_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes
        self._out_frames: list[Frame] = []
        self._in_frames: Sequence[Frame] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._env_decoder = msgspec.msgpack.Decoder(Envelope)
        self._decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}

    # -- encode ---------------------------------------------------------------
    def encode(self, env: Envelope, msg: Message) -> list[Frame]:
        self._out_frames = []
        try:
            body = self._encoder.encode(msg)
            frames: list[Frame] = [self._encoder.encode(env), body, *self._out_frames]
        finally:
            self._out_frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            # ascontiguousarray would turn a 0-d array into shape (1,): keep obj's shape.
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            flat: Any = arr.reshape(-1)  # numpy's stubs do not say ndarray is a Buffer
            self._out_frames.append(memoryview(flat).cast("B"))
            return {
                "__tensor__": len(self._out_frames) - 1,
                "dtype": arr.dtype.str,
                "shape": list(obj.shape),
            }
        raise TypeError(f"cannot encode {type(obj).__name__} in a message")

    # -- decode ---------------------------------------------------------------
    def decode(self, frames: Sequence[Frame]) -> tuple[Envelope, Message]:
        if len(frames) < 2:
            raise DecodeError(f"expected at least 2 frames (envelope, body), got {len(frames)}")
        try:
            env = self._env_decoder.decode(frames[0])
        except msgspec.DecodeError as exc:
            raise DecodeError(f"bad envelope: {exc}") from None
        size = sum(map(len, frames))
        if size > self.max_message_bytes:
            raise MessageTooLarge(
                f"message {env.tag!r} is {size} bytes, over the {self.max_message_bytes}-byte limit",
                env,
            )
        decoder = self._decoders.get(env.tag)
        if decoder is None:
            cls = type_for_tag(env.tag)
            if cls is None:
                raise DecodeError(f"unknown message tag {env.tag!r}", env)
            decoder = self._decoders[env.tag] = msgspec.msgpack.Decoder(
                cls, dec_hook=self._dec_hook
            )
        self._in_frames = frames
        try:
            msg = decoder.decode(frames[1])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise DecodeError(f"invalid {env.tag!r} message: {exc}", env) from None
        finally:
            self._in_frames = ()
        return env, msg

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if typ is np.ndarray and isinstance(obj, dict) and "__tensor__" in obj:
            index = 2 + int(obj["__tensor__"])
            if index >= len(self._in_frames):
                raise msgspec.ValidationError(f"tensor frame {index} missing")
            arr = np.frombuffer(self._in_frames[index], dtype=np.dtype(obj["dtype"]))
            return arr.reshape(obj["shape"])
        raise msgspec.ValidationError(f"expected {typ.__name__}, got {type(obj).__name__}")
