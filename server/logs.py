"""The server's log lines: text for a person, or one JSON object per line for a log pipeline.

Every call gets a request id: the client's own (gRPC metadata or HTTP header `x-request-id`,
when it is a short token) or a new one. The server returns it (gRPC trailing metadata, HTTP
response header) and writes it into the JSON lines logged while it handles the call, so a
client's report of a call finds the server's lines about it."""
from __future__ import annotations

import contextvars
import json
import logging
import random
import re

HEADER = "x-request-id"
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def request_id(given: str = "") -> str:
    """`given` if it is a short token (it goes into logs and headers as it is), else a new id (not a
    secret: from `random`, without uuid4's system call per call)."""
    return given if given and re.fullmatch(r"[\w.:-]{1,64}", given) else f"{random.getrandbits(64):016x}"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if REQUEST_ID.get():
            entry["request_id"] = REQUEST_ID.get()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, form: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if form == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
