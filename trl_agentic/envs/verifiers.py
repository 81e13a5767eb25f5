"""verifiers environments as task suites: `from_verifiers(env)` or `get_task("verifiers:<id>")`, for the verifiers
release that is installed.

[verifiers](https://github.com/PrimeIntellect-ai/verifiers) (the Environments Hub behind prime-rl) changed its API
between 0.3 and 0.4, so this module is one entry point over two adapters, chosen by the installed version:

- **verifiers 0.4.x** (`verifiers.v1`, `pip install 'trl-agentic[verifiers]'`): a `vf.Env` (a taskset of tasks
  played by a harness program in a runtime, behind verifiers' interception proxy) runs one `Env.run_episode` per
  episode with the model client pointed at the episode's own endpoint URL; the trace's rewards are the reward
  functions. [`verifiers_v1.py`](verifiers_v1.py).
- **verifiers 0.3.1 to 0.3.x** (`vf.Environment`, `pip install 'trl-agentic[verifiers-legacy]'`): the environment's
  own rollout loop runs over the episode's client; its rubric's functions are the reward functions.
  [`verifiers_legacy.py`](verifiers_legacy.py).

Both export `from_verifiers`, `load_verifiers_suite`, `VerifiersAgent`, `VerifiersResult`, `VerifiersSuite` and
`verifiers_state`; any other release is refused at import with what to install ([`require_supported_verifiers`]).
docs/envs_verifiers.md says what each runs and what an environment can see.

Example:

```python
>>> import verifiers.v1 as vf  # verifiers 0.4
>>> from trl_agentic.envs import from_verifiers
>>> env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "my-taskset"},
...                                                 agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}))
>>> suite = from_verifiers(env)  # or get_task("verifiers:my-taskset")
>>> config = AgenticGRPOConfig(..., reward_weights=suite.reward_weights, agent_columns=list(suite.agent_columns))
```
"""

from __future__ import annotations

import importlib.metadata
import itertools


# The verifiers releases this entry point runs: [first, end); below LEGACY_END the 0.3 adapter, from it the 0.4 one.
SUPPORTED_VERIFIERS = ("0.3.1", "0.5")
LEGACY_END = "0.4"


def require_supported_verifiers(version: str) -> None:
    """Raise an `ImportError` saying what to install when `version` (of the installed `verifiers`) is not one of the
    releases an adapter runs (0.3.1 to 0.4.x).

    Example:

    ```python
    >>> require_supported_verifiers("0.4.0")  # fine (and "0.3.1")
    >>> require_supported_verifiers("0.5.0")
    Traceback (most recent call last):
    ImportError: verifiers 0.5.0 is installed, but trl_agentic.envs.verifiers runs verifiers >=0.3.1,<0.5 ...
    ```
    """
    first, end = (_release(v) for v in SUPPORTED_VERIFIERS)
    found = _release(version)
    if first <= found < end:
        return
    why = (
        "a release newer than the ones it was tested with"
        if found >= end
        else "older releases lack the verifiers.legacy clients the 0.3 adapter uses"
    )
    raise ImportError(
        f"verifiers {version} is installed, but trl_agentic.envs.verifiers runs verifiers >={SUPPORTED_VERIFIERS[0]},"
        f"<{SUPPORTED_VERIFIERS[1]} ({why}). Install a supported release: pip install 'trl-agentic[verifiers]' "
        "(verifiers 0.4), or 'trl-agentic[verifiers-legacy]' (0.3.x; it pins mcp<2, so not alongside [mcp])."
    )


def uses_legacy_api(version: str) -> bool:
    """Whether `version` of verifiers is a 0.3 release (`vf.Environment`), run by `verifiers_legacy.py`."""
    return _release(version) < _release(LEGACY_END)


def _release(version: str) -> tuple[int, ...]:
    # "0.3.1" -> (0, 3, 1); "0.4.0.dev2" / "0.4.0rc1" -> (0, 4, 0): pre-releases count as their release.
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


try:
    VERIFIERS_VERSION = importlib.metadata.version("verifiers")
except importlib.metadata.PackageNotFoundError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trl_agentic.envs.verifiers needs the `verifiers` package: pip install 'trl-agentic[verifiers]'."
    ) from error
require_supported_verifiers(VERIFIERS_VERSION)
if uses_legacy_api(VERIFIERS_VERSION):
    from .verifiers_legacy import *  # noqa: E402, F403
    from .verifiers_legacy import __all__ as _adapter_names  # noqa: E402
else:
    from .verifiers_v1 import *  # noqa: E402, F403
    from .verifiers_v1 import __all__ as _adapter_names  # noqa: E402

__all__ = [
    *_adapter_names,
    "LEGACY_END",
    "SUPPORTED_VERIFIERS",
    "VERIFIERS_VERSION",
    "require_supported_verifiers",
    "uses_legacy_api",
]
