"""pytest -n N: a worker that runs out of tests takes some queued for another (xdist's worksteal), where xdist's
default (load) leaves them queued: the suite's long tests ended on one worker while the other idled for minutes."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "worksteal"  # before xdist's own hook, which makes "no" "load" and keeps any other
