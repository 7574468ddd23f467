"""Order arithmetic, kept apart from the job as a team's helper module would be (an edit here is a new code version
of the whole package: the deploy's hash covers every file)."""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

MONEY = "decimal(18,2)"


def order_value(items: Column) -> Column:
    """The sum of quantity × price over an order's items, exactly (decimal)."""
    zero = F.lit(0).cast(MONEY)
    return F.aggregate(items, zero, lambda total, item: (total + item["qty"] * item["price"]).cast(MONEY))


def item_count(items: Column) -> Column:
    return F.aggregate(items, F.lit(0).cast("bigint"), lambda n, item: n + item["qty"])
