"""The bearer token: one rule for gRPC metadata and HTTP headers alike."""
from __future__ import annotations

import hmac


class Token:
    REFUSAL = "missing or wrong bearer token"

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    def allows(self, authorization: str) -> bool:
        return hmac.compare_digest(authorization.encode(), self.expected)  # constant time: leaks no prefix
