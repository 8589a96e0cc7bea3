"""The test bed as a pytest fixture: real hosts n0..nN-1 on this machine (`testbed/`), for tests
that need a rank per host. In a test module:

    from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

    TESTBED_HOSTS = 3  # default 2
    TESTBED_SLURM = True  # a Slurm cluster over the hosts too (default False)

    def test_something(bed):  # a testbed.Bed, every host up
        subprocess.run([mpiexec, *bed.launcher_args(), "-hosts", "n0,n1", ...], timeout=...)

The bed comes up once per module and always goes down at its end, also when a test failed; a
test that killed, cut or took down the bed leaves it to be healed (or brought up again) before
the next test. Where the bed cannot run (not root, no namespaces) the tests skip, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import testbed


@pytest.fixture(scope="module", name="bed_module")
def bed_module_fixture(request: pytest.FixtureRequest) -> Iterator[int]:
    """The module's bed size; brings the bed down at the module's end whatever happened."""
    why = testbed.available()
    if not why and getattr(request.module, "TESTBED_SLURM", False):
        why = testbed.slurm_missing()
    if why:
        pytest.skip(why)
    n = getattr(request.module, "TESTBED_HOSTS", 2)
    try:
        yield n
    finally:
        testbed.down()


@pytest.fixture(name="bed")
def bed_fixture(bed_module: int, request: pytest.FixtureRequest) -> testbed.Bed:
    """The module's bed with every host up (healed, or brought up again, as needed; a bed of
    another size, or without the Slurm cluster the module wants, is taken down first)."""
    slurm = getattr(request.module, "TESTBED_SLURM", False)
    bed = testbed.current()
    if bed is not None and (bed.plan.n != bed_module or bed.slurm != slurm):
        testbed.down()
        bed = None
    if bed is None:
        return testbed.up(bed_module, slurm_cluster=slurm)
    for s in bed.status():
        if s.state != "up" or not s.link_up:
            bed.heal(s.name)
    return bed
