"""mtp's members and per-request options, apart from its spec so that the proposers read them
without importing the spec (whose builder imports the proposers)."""

from specserve.methods.registry import Member, OptionSpec

# In tie-break order; the remote proposer's proposer mask has bit i for member i.
MEMBERS = (Member("mtp_heads", "mtp", ("mtp_heads",)),
           Member("eagle", "eagle", ("eagle_backbone", "calibration_head")),
           Member("draft", "draft", ("draft_drafter",)),
           Member("ngram", None, ("ngram_drafter",)))
# Every sub-proposer `mtp` knows, in that order. A deployment serves those it has (the MTP heads
# and the draft model need trained weights; eagle its drafter; ngram needs nothing).
SUBPROPOSERS = tuple(m.name for m in MEMBERS)

# Per request: the merged tree's nodes at most, and the members whose drafts it merges.
TREE_BUDGET = OptionSpec("mtp_tree_budget", "an integer", tier_setting="tree_budget")
PROPOSERS = OptionSpec("mtp_proposers", "a list of strings", tier_setting="proposers")
