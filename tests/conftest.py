import os

import pytest

# The Triton interpreter (CPU) must be chosen before `triton` is first imported: the kernels read it
# when they are decorated. Without it, forcing the Triton path on a machine with no GPU cannot run.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def served_models(tmp_path_factory):
    """tests/served.py's tiny models, trained once per test session (about a minute)."""
    from tests.served import train_models

    return train_models(tmp_path_factory.mktemp("served"))


def pytest_collection_modifyitems(items):
    """A test that needs the trained models is slow by that alone: they take the first such test a
    minute or more to train (make test-fast leaves it out)."""
    for item in items:
        if "served_models" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
