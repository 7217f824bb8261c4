"""Messages that thread workers post to the UI (a worker never touches a widget)."""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class ResponseStarted(Message):
    reply_id: int


@dataclass
class TokenArrived(Message):
    reply_id: int
    text: str


@dataclass
class ResponseDone(Message):
    reply_id: int
    status: str            # complete | stopped
    finish_reason: str
    summary: str


@dataclass
class ResponseFailed(Message):
    reply_id: int
    error: str


@dataclass
class ModelProgress(Message):
    stage: str
    done: int
    total: int


@dataclass
class ModelLoaded(Message):
    engine: object


@dataclass
class ModelFailed(Message):
    spec: str
    error: str


@dataclass
class AttachmentReady(Message):
    attachment: object     # core.attachments.Attachment
    n_tokens: int


@dataclass
class AttachmentRefused(Message):
    error: str
