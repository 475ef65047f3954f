"""The flow tests run their flows in this process, on the session's Ray head (`ray_head`,
tests/integration/conftest.py) and Prefect in ephemeral mode; each test uses its own run name."""
