"""Prices on one basis (harness/prices.py, the profiles' [price] tables): every price dated, sourced and
on-demand; a user's --prices file replaces them GPU by GPU; rows are costed again from their throughput."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from harness.prices import Price, cost_rows, price_table, priced_profiles, read_prices
from harness.profiles import BUILTIN_PROFILES_DIR, ProfileError, load_profile, load_profiles

PROFILES = load_profiles()


def test_every_shipped_price_is_on_demand_dated_and_sourced():
    priced = [p for p in PROFILES.values() if p.usd_per_hour]
    assert len(priced) >= 10
    for profile in priced:
        assert re.fullmatch(r"\d{4}(-\d{2}(-\d{2})?)?", profile.price_date), profile.id
        assert profile.price_source, profile.id
    # Reserved blocks (the H200's only record) and undated offers (the MI300X's) are not on-demand prices.
    assert PROFILES["h200"].usd_per_hour is None and PROFILES["mi300x"].usd_per_hour is None


@pytest.mark.parametrize(("change", "field"), [
    ('basis = "on-demand"', "price.basis"),           # a price without its basis
    ('date = "2026-05-07"', "price.date"),            # an undated price
])
def test_a_price_without_basis_or_date_is_refused(tmp_path, change, field):
    text = (BUILTIN_PROFILES_DIR / "a10.toml").read_text()
    broken = text.replace(change, 'date = "undated"' if "date" in change else "")
    path = tmp_path / "a10.toml"
    path.write_text(broken)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert field in str(info.value) and len(str(info.value).splitlines()) == 1


def _prices_file(tmp_path, text: str):
    path = tmp_path / "prices.csv"
    path.write_text(text)
    return path


def test_a_prices_file_replaces_the_profiles_price_gpu_by_gpu(tmp_path):
    path = _prices_file(tmp_path, "gpu,usd_per_hour,date,source\nh200,3.50,2026-11,our contract\n"
                                  "mi250x,4.00,2026-11,a whole package\n")
    prices = price_table(PROFILES, path)
    assert prices["h200"] == Price("h200", 3.5, "2026-11", "our contract")
    assert prices["a10"].usd_per_hour == PROFILES["a10"].usd_per_hour  # untouched
    assert prices["mi250x"].usd_per_hour == 4.0 and prices["mi250x"].per_device == pytest.approx(2.0)  # 2 GCDs
    assert prices["mi250x"].label == "$4.00/h ($2.00 per device), 2026-11"


def test_priced_profiles_carry_the_files_price_where_it_names_the_gpu(tmp_path):
    path = _prices_file(tmp_path, "gpu,usd_per_hour,date,source\nh200,3.50,2026-11,our contract\n"
                                  "mi250x,4.00,2026-11,a whole package\n")
    priced = priced_profiles(PROFILES, path)
    assert (priced["h200"].usd_per_hour, priced["h200"].price_date, priced["h200"].price_source) == \
        (3.5, "2026-11", "our contract")
    assert priced["mi250x"].per_device().usd_per_hour == pytest.approx(2.0)  # a package's price, shared by 2 GCDs
    assert priced["a10"] == PROFILES["a10"] and PROFILES["h200"].usd_per_hour is None  # others and the source kept
    assert priced_profiles(PROFILES, None) is PROFILES


@pytest.mark.parametrize(("text", "fragment"), [
    ("gpu,usd_per_hour,date,source\nh20,3,2026,x\n", "did you mean h200"),
    ("gpu,usd_per_hour,date,source\nh200,-3,2026,x\n", "positive number"),
    ("gpu,usd_per_hour,date,source\nh200,3,,x\n", "date"),
    ("gpu,usd_per_hour,date,source\nh200,3,2026,x\nh200,4,2026,y\n", "twice"),
    ("gpu,price\nh200,3\n", "missing: usd_per_hour, date, source"),
    ("gpu,usd_per_hour,date,source\n", "no prices under the header"),
    ("gpu,usd_per_hour,date,source,basis\nh200,3,2026,x,spot\n", "mix bases"),
])
def test_a_bad_prices_file_is_one_line(tmp_path, text, fragment):
    with pytest.raises(ValueError) as info:
        price_table(PROFILES, _prices_file(tmp_path, text))
    message = str(info.value)
    assert fragment in message and "--prices" in message and len(message.splitlines()) == 1


def test_a_missing_prices_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_prices(tmp_path / "none.csv", PROFILES)


def test_rows_are_costed_from_throughput_at_the_table_price():
    prices = {"a10": Price("a10", 0.9, "2026", "x")}
    columns = ["gpu", "mode", "throughput_samples_s", "world_size", "seq_len", "gen_len"]
    frame = pd.DataFrame([("a10", "train", 10.0, 1, 1000, None), ("a10", "train", 10.0, 4, None, None),
                          ("a10", "infer", 2.0, 1, 500, 100), ("l4", "train", 10.0, 1, None, None)], columns=columns)
    costed = cost_rows(frame, prices)
    per_million = 0.9 / 3600 / 10 * 1e6
    assert costed["usd_per_million_samples"][0] == pytest.approx(per_million)
    assert costed["usd_per_million_tokens"][0] == pytest.approx(per_million / 1000)
    assert costed["usd_per_million_samples"][1] == pytest.approx(4 * per_million)  # four GPUs rented
    # A served decoder is costed per generated token (the prompt's prefill is in its throughput).
    assert costed["usd_per_million_tokens"][2] == pytest.approx(0.9 / 3600 / 2 * 1e6 / 100)
    assert pd.isna(costed["usd_per_million_samples"][3]) and costed["price_label"][3] == "no price known"
    assert costed["price_label"][0] == "$0.90/h, 2026"


def test_a_price_over_a_year_old_is_flagged_in_the_prices_table():
    from datetime import date

    from harness.prices import age_text
    from reports.build import price_rows

    today = date(2026, 12, 4)
    assert age_text(Price("a", 1.0, "2026-11-20", "s"), today) == "14 days"
    assert age_text(Price("a", 1.0, "2026-05", "s"), today) == "7 months"
    assert age_text(Price("a", 1.75, "2024-05", "s"), today) == "2.6 years: re-check, prices have moved since"
    profiles = load_profiles()
    frame = pd.DataFrame({"gpu": ["a10", "a100-sxm4-80gb"]})
    prices = {"a10": Price("a10", 0.86, "2026-05-07", "s"),
              "a100-sxm4-80gb": Price("a100-sxm4-80gb", 1.75, "2024", "s")}
    ages = {row["GPU"]: row["age"] for row in price_rows(prices, profiles, frame, today)}
    assert ages == {"a10": "7 months", "a100-sxm4-80gb": "2.9 years: re-check, prices have moved since"}


@pytest.mark.parametrize("day", ["2025-13", "2025-02-30", "2025-00"])
def test_a_price_date_that_is_no_day_is_refused_where_it_is_read(tmp_path, day):
    path = _prices_file(tmp_path, f"gpu,usd_per_hour,date,source\na10,0.9,{day},quote\n")
    with pytest.raises(ValueError, match="line 2: every price needs a date"):
        read_prices(path, load_profiles())
    text = (BUILTIN_PROFILES_DIR / "a10.toml").read_text().replace('date = "2026-05-07"', f'date = "{day}"')
    (tmp_path / "a10.toml").write_text(text)
    with pytest.raises(ProfileError, match="price.date"):
        load_profile(tmp_path / "a10.toml")
