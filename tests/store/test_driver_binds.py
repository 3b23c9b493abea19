"""A `DriverStatement`'s parameters (`Binds`, planned once per statement) are exactly those
SQLAlchemy's own `construct_params` and type processors make, on both databases: checked
call by call while the store's hottest paths (admission with a claim, sample batches that
end units and requests, leases) run, and on the edge cases of binds."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import bindparam, column, literal, select, table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import InvalidRequestError

from tests.store import test_leases, test_sample_batches
from tltd.store import Store
from tltd.store.database import Binds, DriverStatement
from tltd.store.tables import UTCDateTime


def _reference(binds: Binds, params) -> object:
    """What the statement's parameters were before `Binds`: SQLAlchemy's construct_params,
    then each bind's processor, in the compiled order on a positional dialect."""
    values = binds.compiled.construct_params(params)
    for key, process in binds.processors.items():
        if key in values:
            values[key] = process(values[key])
    order = binds.compiled.positiontup
    return values if order is None else tuple(values[k] for k in order)


def _plain(value):
    """psycopg's wrappers (JSON, binary) compare by identity: compare what they wrap."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if type(value).__module__.startswith("psycopg") and hasattr(value, "obj"):
        return type(value).__name__, _plain(value.obj)
    return value


@pytest.fixture
def checked_binds(monkeypatch) -> list[int]:
    calls: list[int] = []
    planned = Binds.__call__

    def checked(self, params):
        got = planned(self, params)
        assert _plain(got) == _plain(_reference(self, params))
        calls.append(1)
        return got

    monkeypatch.setattr(Binds, "__call__", checked)
    return calls


@pytest.mark.parametrize(
    "workflow",
    [
        test_leases.test_a_request_admitted_with_a_claim_leases_what_fits_to_its_node,
        test_leases.test_a_sample_batch_records_the_units_it_completes,
        test_leases.test_a_sample_batch_that_completes_several_units_ends_each_and_counts_every_sample,
        test_sample_batches.test_a_batch_stores_every_column_as_a_single_write_does,
        test_sample_batches.test_a_batch_stores_each_sample_by_the_single_write_rules,
    ],
    ids=lambda f: f.__name__,
)
def test_the_store_paths_bind_as_sqlalchemy_would(store: Store, checked_binds, workflow) -> None:
    workflow(store)
    assert checked_binds  # the workflow ran driver statements


T = table("t", column("a"), column("b"), column("at", UTCDateTime()))


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.psycopg.dialect()],
                         ids=["sqlite", "postgresql"])  # fmt: skip
def test_binds_edge_cases(dialect) -> None:
    at = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    statement = DriverStatement(
        select(T.c.a, literal(7).label("seven"))
        .where(T.c.a == 5, T.c.b == bindparam("b"), T.c.at < bindparam("at", type_=UTCDateTime()))
        .where(T.c.b != bindparam("b"))  # one bind used twice
        .where(T.c.a != bindparam("later", callable_=lambda: 11))
    )
    binds, _ = statement._compiled_for(dialect)
    for params in ({"b": "x", "at": at}, {"b": None, "at": at, "later": 3}):
        assert binds(params) == _reference(binds, params)
    with pytest.raises(InvalidRequestError, match="'b'"):
        binds({"at": at})
    insert = DriverStatement(T.insert(), columns=("a", "b", "at"))
    row = {"a": 1, "b": "y", "at": at}
    binds, _ = insert._compiled_for(dialect)
    assert binds(row) == _reference(binds, row)
