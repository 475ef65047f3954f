"""Targets for tests/integration/rollout/test_sandbox.py: a Python tool that runs the code it is
given, as a code-interpreter tool runs the model's code."""


def run_code(code: str):
    scope: dict = {}
    exec(code, scope)  # the point: untrusted code, inside the sandbox
    return scope.get("result")
