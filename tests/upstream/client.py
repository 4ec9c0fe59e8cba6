"""A Sessions client on grpcio with its default settings (no authority override), as an
upstream user's script would be: create a session of HARNESS, run one turn, print the
assistant's text.

    client.py --stubs DIR --target unix:PATH --harness NAME --input TEXT
"""
import argparse
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--target", required=True, help="unix:PATH, as grpcio takes it")
    parser.add_argument("--harness", required=True)
    parser.add_argument("--input", required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc
    import common_pb2
    import session_pb2
    import session_pb2_grpc

    with grpc.insecure_channel(args.target) as channel:
        sessions = session_pb2_grpc.SessionsStub(channel)
        created = sessions.CreateSession(
            session_pb2.CreateSessionRequest(session=session_pb2.Session(harness=args.harness)),
            timeout=30,
        )
        request = session_pb2.ExecRequest(
            session=created.metadata.uid,
            inputs=[
                common_pb2.Message(
                    role="user",
                    parts=[common_pb2.Part(text=common_pb2.TextPart(text=args.input))],
                )
            ],
        )
        out = []
        for update in sessions.Exec(request, timeout=30):
            if update.WhichOneof("update") != "record":
                continue
            event = update.record.event
            if event.WhichOneof("body") == "message" and event.message.role == "assistant":
                out.extend(p.text.text for p in event.message.parts)
        print("".join(out))


if __name__ == "__main__":
    main()
