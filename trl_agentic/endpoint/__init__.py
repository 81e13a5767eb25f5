"""The endpoint agents talk to (Chat Completions, Responses, Anthropic Messages, Gemini): one episode per key, every
sampled token recorded.

`launch.py` builds it (engine + renderer + settings + server) for the trainer, `trl-agentic eval`, the demo and
`trl-agentic serve`; `app.py` builds the app (`create_app`, error shapes), `routes.py` holds one router per wire
format over `admission.py` (who may call), `service.py` the format-neutral model call, and `chat_completions.py`,
`responses.py`, `anthropic_messages.py`, `gemini.py` one adapter per wire format.
"""

# The `model` agents send (`client.chat.completions.create(model="policy", ...)`); any other name is answered 404.
# Defined once here, a module with no imports, so that every layer (tasks' agents, the runner, the trainer, eval,
# serve) can name it without importing the endpoint's machinery.
SERVED_MODEL_NAME = "policy"

__all__ = ["SERVED_MODEL_NAME"]
