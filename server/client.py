"""Python client and CLI for a gret-serve server.

    python -m server.client translate --to en "Ein Hund läuft."
    python -m server.client translate --to en < brief.txt   # the whole file as one document
    python -m server.client summarize "long article ..."
    python -m server.client models
    python -m server.client health           # exit 0 when SERVING (Docker HEALTHCHECK)

Library: Client("localhost:50051").translate(["Ein Hund läuft."], target="en", beam_size=4)
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc

OPTION_FIELDS = {f.name for f in pb.DecodingOptions.DESCRIPTOR.fields}


class Client:
    def __init__(self, address: str = "localhost:50051", token: str | None = None, tls_ca: str | None = None,
                 timeout: float | None = None):
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None
        self.timeout = timeout

    def translate(self, texts: list[str], target: str = "", source: str = "", model: str = "",
                  as_one_sequence: bool = False, html: bool = False, priority: int = 0,
                  **options) -> pb.GenerateResponse:
        request = pb.TranslateRequest(texts=texts, source_language=source, target_language=target, model=model,
                                      as_one_sequence=as_one_sequence, format=pb.HTML if html else pb.TEXT,
                                      priority=priority, options=decoding_options(**options))
        return self.stub.Translate(request, timeout=self.timeout, metadata=self.metadata)

    def translate_stream(self, texts: list[str], target: str = "", source: str = "", model: str = "",
                         stream_sentences: bool = False, html: bool = False, priority: int = 0, **options):
        """One response per text as it finishes; with stream_sentences, each sentence before it (partial)."""
        request = pb.TranslateRequest(texts=texts, source_language=source, target_language=target, model=model,
                                      stream_sentences=stream_sentences, format=pb.HTML if html else pb.TEXT,
                                      priority=priority, options=decoding_options(**options))
        return self.stub.TranslateStream(request, timeout=self.timeout, metadata=self.metadata)

    def summarize(self, texts: list[str], model: str = "", priority: int = 0, **options) -> pb.GenerateResponse:
        request = pb.SummarizeRequest(texts=texts, model=model, priority=priority, options=decoding_options(**options))
        return self.stub.Summarize(request, timeout=self.timeout, metadata=self.metadata)

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata).models)

    def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decoding_options(**options) -> pb.DecodingOptions:
    """target_prefix may be one text (for every text) or a list (one for every text, or one each)."""
    unknown = sorted(set(options) - OPTION_FIELDS)
    if unknown:
        raise TypeError(f"unknown decoding options {unknown}; known: {sorted(OPTION_FIELDS)}")
    if isinstance(options.get("target_prefix"), str):
        options["target_prefix"] = [options["target_prefix"]]
    return pb.DecodingOptions(**{k: v for k, v in options.items() if v is not None})


def stdin_texts(command: str) -> list[str]:
    """A translation reads stdin as one document (the server splits it into sentences and keeps
    its layout); headlines and subjects are one per text, so a summary reads each non-blank line."""
    if command == "translate":
        return [sys.stdin.read()]
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("GRET_SERVE_ADDRESS", "localhost:50051"))
    p.add_argument("--token", default=os.environ.get("GRET_SERVE_TOKEN"), help="bearer token")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to connect with TLS")
    p.add_argument("--timeout", type=float, default=60.0)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("translate", "summarize"):
        c = sub.add_parser(name)
        c.add_argument("texts", nargs="*", help="texts (default: stdin, translated as one document with its "
                                                "paragraphs and blank lines; summarised one line at a time)")
        c.add_argument("--model", default="")
        if name == "translate":
            c.add_argument("--from", dest="source", default="")
            c.add_argument("--to", dest="target", default="")
            c.add_argument("--html", action="store_true",
                           help="the texts are HTML: translate the text, keep the markup")
        c.add_argument("--prefix", help="the output begins with this text (each text's, or each document's "
                                         "first sentence's)")
        c.add_argument("--beam", type=int)
        c.add_argument("--n-best", type=int)
        c.add_argument("--scores", action="store_true")
        c.add_argument("--priority", type=int, default=0, help="-10..10: a higher priority is admitted first")
    sub.add_parser("models")
    sub.add_parser("health")
    args = p.parse_args(argv)
    client = Client(args.address, args.token, args.tls_ca, args.timeout)
    try:
        if args.command == "health":
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else 1
        if args.command == "models":
            for m in client.list_models():
                default = " (default)" if m.is_default else ""
                print(f"{m.name}\t{m.task} {m.source_language}->{m.target_language}\t{m.architecture}\t"
                      f"{m.backend} {m.precision}\tversion {m.version}{default}")
            return 0
        texts = args.texts or stdin_texts(args.command)
        options = dict(beam_size=args.beam, n_best=args.n_best, return_scores=args.scores, target_prefix=args.prefix)
        if args.command == "translate":
            response = client.translate(texts, args.target, args.source, args.model, html=args.html,
                                        priority=args.priority, **options)
        else:
            response = client.summarize(texts, args.model, priority=args.priority, **options)
        for result in response.results:
            for h in result.hypotheses:
                text = f"{h.text}\t{h.score:.4f}" if args.scores else h.text
                print(text, end="" if text.endswith("\n") else "\n")  # a document keeps its own last newline
        return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
