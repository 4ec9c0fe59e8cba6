"""agentvm's Python reference harness: an agentsessions.v1 Harness on grpcio that keeps its
state in memory (REQUIRES_MEMORY_SNAPSHOT) and its files on the session's workspace disk.

    harness.py --listen unix:PATH

Each turn appends the input text to $AGENTVM_WORKSPACE/turns.log and answers one OUTPUT,
a JSON object: {"count": turns this process has served, "said": the input text,
"logged": lines now in turns.log, "python": the interpreter's version, "random": a draw
from Python's `random`}. A memory snapshot
keeps the count, the workspace keeps the log, and a fork child carries on with both.

An input `connect HOST:PORT` also opens a TCP connection there (through the VM's network,
where its image allows one) and adds "connect": {"line": the first line the server sent}
or {"error": why not}.

Restores, forks and starts from a template: the agent sends the signal named in
$AGENTVM_RESTORE_SIGNAL (SIGWINCH) after the VM's kernel RNG is reseeded. `random` was seeded
when this process started, so every VM of one snapshot would draw the same numbers: the
handler reseeds it from the (fresh) kernel RNG.
"""
import argparse
import concurrent.futures
import json
import os
import platform
import random
import signal
import socket
import threading

import grpc

import common_pb2
import harness_pb2
import harness_pb2_grpc


class Reference(harness_pb2_grpc.HarnessServicer):
    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def Describe(self, request, context):
        return harness_pb2.HarnessDescriptor(
            id="python-reference",
            version="1",
            capabilities=harness_pb2.Capabilities(
                resumability=harness_pb2.RESUMABILITY_REQUIRES_MEMORY_SNAPSHOT
            ),
        )

    def Connect(self, request_iterator, context):
        first = next(request_iterator)
        start = first.start
        text = ""
        if start.inputs:
            text = "".join(p.text.text for p in start.inputs[-1].parts)
        with self.lock:
            self.count += 1
            count = self.count
            logged = None
            workspace = os.environ.get("AGENTVM_WORKSPACE")
            if workspace:
                log = os.path.join(workspace, "turns.log")
                with open(log, "a", encoding="utf-8") as f:
                    f.write(text + "\n")
                with open(log, encoding="utf-8") as f:
                    logged = sum(1 for _ in f)
        answer = {
            "count": count,
            "said": text,
            "logged": logged,
            "python": platform.python_version(),
            "random": random.random(),
        }
        if text.startswith("connect "):
            answer["connect"] = first_line(text[len("connect "):])
        yield common_pb2.Event(
            execution_id=first.execution_id,
            kind=common_pb2.EVENT_OUTPUT,
            message=common_pb2.Message(
                role="assistant",
                parts=[common_pb2.Part(text=common_pb2.TextPart(text=json.dumps(answer)))],
            ),
        )
        yield common_pb2.Event(
            execution_id=first.execution_id,
            kind=common_pb2.EVENT_END,
            end=common_pb2.HarnessEnd(state="COMPLETED"),
        )


def first_line(target):
    """The first line the TCP server at HOST:PORT sends, or why there is none."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3) as conn:
            line = conn.makefile("rb").readline(256)
        return {"line": line.decode("utf-8", "replace").rstrip("\n")}
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True, help="unix:PATH")
    args = parser.parse_args()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    harness_pb2_grpc.add_HarnessServicer_to_server(Reference(), server)
    server.add_insecure_port(args.listen)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    restored = getattr(signal, os.environ.get("AGENTVM_RESTORE_SIGNAL", ""), None)
    if restored is not None:
        # random.seed() with no argument draws its seed from os.urandom.
        signal.signal(restored, lambda *_: random.seed())
    stop.wait()
    server.stop(grace=2)


if __name__ == "__main__":
    main()
