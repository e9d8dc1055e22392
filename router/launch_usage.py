"""What ``dsv3serve serve`` prints once the app is up (URLs, example calls), and the
one request of its ``--check``."""

from __future__ import annotations

import sys

APP_NAME = "dsv3serve"


def usage_text(url: str, model: str, grpc_port: int | None = None, app: str = APP_NAME) -> str:
    """What to print once the app is up: the URLs and example calls."""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}'
    )
    text = (
        f"dsv3serve is up at {url}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  {sys.executable} -c \"from openai import OpenAI; c = OpenAI(base_url='" + url + "/v1', "
        "api_key='none'); print(c.chat.completions.create(model='" + model + "', "
        "messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=32)"
        '.choices[0].message.content)"\n\n'
    )
    if grpc_port is not None:
        text += (
            f"gRPC (dsv3serve.v1.Generation, router/proto/generate.proto) on port {grpc_port}:\n\n"
            f"  {grpc_example(grpc_port, app)}\n\n"
            "With an API key set, add -H 'Authorization: Bearer <key>' (curl), "
            "api_key='<key>' (openai)\nor ('authorization', 'Bearer <key>') to the gRPC "
            "metadata.\n\n"
        )
    return text + "Ctrl-C stops it."


def grpc_example(port: int, app: str = APP_NAME, python: str = sys.executable) -> str:
    """A shell command that streams one chat completion over gRPC with the grpcio and
    stubs the project installs (no grpcurl needed) and prints its text."""
    code = (
        "import grpc; from router.proto import generate_pb2 as pb, generate_pb2_grpc as rpc; "
        f"stub = rpc.GenerationStub(grpc.insecure_channel('127.0.0.1:{port}')); "
        "request = pb.ChatRequest(messages=[pb.ChatMessage(role='user', content='Hello!')], "
        "sampling=pb.SamplingOptions(max_tokens=32)); "
        "print(''.join(m.choice.text for m in stub.ChatCompleteStream(request, "
        f"metadata=[('application', '{app}')])))"
    )
    return f'{python} -c "{code}"'


def check_grpc(port: int, app: str, api_key: str) -> str:
    """The gRPC Health of the app on ``127.0.0.1:port``: its ``status`` ("ok")."""
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    metadata = [("application", app), ("authorization", f"Bearer {api_key}")]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        reply = stub.Health(generate_pb2.HealthRequest(), metadata=metadata, timeout=30)
    return reply.status


def check(url: str, model: str, api_key: str) -> str:
    """One chat completion through the app with the openai client; returns its text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=api_key)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello, who are you?"}],
        max_tokens=16,
        temperature=0,
    )
    return reply.choices[0].message.content or ""
