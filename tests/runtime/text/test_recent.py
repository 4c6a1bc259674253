"""runtime/text/recent.py: the most recently used entries are kept, the least recently used one goes first."""
from runtime.text.recent import Recent


def test_the_least_recently_used_entry_is_dropped_first():
    kept = Recent(2)
    kept.put("a", 1)
    kept.put("b", 2)
    assert kept.get("a") == 1  # "a" is now the most recent
    kept.put("c", 3)
    assert kept.get("b") is None and kept.get("a") == 1 and kept.get("c") == 3 and len(kept) == 2


def test_get_or_make_makes_once_per_kept_key():
    kept, made = Recent(4), []
    for _ in range(3):
        assert kept.get_or_make("k", lambda: made.append(1) or "v") == "v"
    assert made == [1]
