"""The calculator's reference agent as a command (`trl-agentic demo --set agent=command`, `make_calculator_suite(
agent="command")`): the same tool loop as `calculator_agent`, run by a `CommandAgent` in the episode's sandbox.

`python -I -S calculator_command.py` reads the task (a JSON row with `prompt`) on standard input and talks to the
endpoint at `$OPENAI_BASE_URL` with `$OPENAI_API_KEY` over HTTP: it sends the conversation with the calculator's tool
schemas, sends each reply back as returned, answers each tool call with the `calculator` tool's text (errors as text
the model reads, as `tasks/agent_loop.call_tool` words them), and stops when the model answers without a tool call
or after `$AGENT_MAX_ROUNDS` model calls (default 6). Its last line of output is the final text, as JSON. A refused
model call (the endpoint's 4xx, a limit reached) ends it with status 1: the episode is recorded as crashed.

Standard library only, the package not imported (a Python start in ~20 ms, not the seconds `import trl_agentic` and
`openai` take): the tool is `calculator_tool.py`, loaded from beside this file.
"""

from __future__ import annotations

import http.client
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def load_calculator_tool() -> Any:
    """`calculator_tool.py`, beside this file, as a module (without importing the package)."""
    spec = importlib.util.spec_from_file_location("calculator_tool", Path(__file__).with_name("calculator_tool.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_tool(tools: dict[str, Any], name: str, arguments: Any) -> str:
    """One tool call's text, worded as `trl_agentic.tasks.agent_loop.call_tool` words it (tests compare the two)."""
    if name not in tools:
        return f"Error: unknown tool {name!r}. Available tools: {', '.join(sorted(tools))}."
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"Error: the arguments of {name!r} are not valid JSON ({error.msg}). Send a JSON object."
    if not isinstance(arguments, dict):
        return f"Error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
    function = tools[name]
    signature = inspect.signature(function)
    try:
        signature.bind(**arguments)
    except TypeError as error:
        expected = ", ".join(signature.parameters)
        return f"Error: bad arguments for tool {name!r}: {error}. Expected arguments: ({expected})."
    try:
        return str(function(**arguments))
    except Exception as error:  # noqa: BLE001 - the model reads any tool failure as text
        return f"Error: {error}"


class Endpoint:
    """`POST {base_url}/chat/completions` over one kept-alive HTTP connection."""

    def __init__(self, base_url: str, api_key: str):
        parts = urlsplit(base_url)
        connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.connection = connection(parts.hostname, parts.port, timeout=600)
        self.path = parts.path.rstrip("/") + "/chat/completions"
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.connection.request("POST", self.path, json.dumps(body), self.headers)
        response = self.connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"the endpoint answered {response.status}: {payload[:500].decode(errors='replace')}")
        return json.loads(payload)


def run_episode(endpoint: Endpoint, task: dict[str, Any], model: str, max_rounds: int) -> str:
    """The tool loop: the final message's text (`""` when it had none)."""
    tool = load_calculator_tool()
    tools = {"calculator": tool.calculator}
    messages, message = list(task["prompt"]), None
    for _ in range(max_rounds):
        response = endpoint.chat({"model": model, "messages": messages, "tools": tool.CALCULATOR_TOOLS})
        message = response["choices"][0]["message"]
        messages.append(message)  # sent back exactly as returned
        if not message.get("tool_calls"):
            break
        for tool_call in message["tool_calls"]:
            if tool_call.get("type") != "function":
                content = (
                    f"Error: unsupported tool call type {tool_call.get('type')!r}; call one of the provided functions."
                )
            else:
                content = call_tool(tools, tool_call["function"]["name"], tool_call["function"].get("arguments"))
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": content})
    return (message or {}).get("content") or ""


def main() -> int:
    task = json.load(sys.stdin)
    endpoint = Endpoint(os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", ""))
    model = task.get("model") or os.environ.get("OPENAI_MODEL") or "policy"
    try:
        text = run_episode(endpoint, task, model, int(os.environ.get("AGENT_MAX_ROUNDS", "6")))
    except (RuntimeError, OSError) as error:
        print(f"calculator agent: {error}", file=sys.stderr)
        return 1
    print(json.dumps(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
