"""A harness on grpcio, written the way upstream's harnesses are: Connect reads the Start
frame before it sends anything, so no response headers leave the server until the host has
sent Start. A host that waits for headers before sending Start deadlocks against it.

    read_first_harness.py --stubs DIR --listen unix:PATH

Answers each execution with one OUTPUT "py:<last input text>" and END COMPLETED.
"""
import argparse
import concurrent.futures
import signal
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stubs", required=True, help="directory of the generated *_pb2 modules")
    parser.add_argument("--listen", required=True, help="unix:PATH")
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc
    import common_pb2
    import harness_pb2
    import harness_pb2_grpc

    class ReadFirst(harness_pb2_grpc.HarnessServicer):
        def Describe(self, request, context):
            return harness_pb2.HarnessDescriptor(
                id="py-read-first",
                version="1",
                capabilities=harness_pb2.Capabilities(
                    resumability=harness_pb2.RESUMABILITY_STATELESS_REPLAY
                ),
            )

        def Connect(self, request_iterator, context):
            first = next(request_iterator)
            start = first.start
            text = ""
            if start.inputs:
                text = "".join(p.text.text for p in start.inputs[-1].parts)
            yield common_pb2.Event(
                execution_id=first.execution_id,
                kind=common_pb2.EVENT_OUTPUT,
                message=common_pb2.Message(
                    role="assistant",
                    parts=[common_pb2.Part(text=common_pb2.TextPart(text="py:" + text))],
                ),
            )
            yield common_pb2.Event(
                execution_id=first.execution_id,
                kind=common_pb2.EVENT_END,
                end=common_pb2.HarnessEnd(state="COMPLETED"),
            )

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    harness_pb2_grpc.add_HarnessServicer_to_server(ReadFirst(), server)
    server.add_insecure_port(args.listen)
    server.start()
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()


if __name__ == "__main__":
    main()
