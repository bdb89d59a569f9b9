"""dflash's per-request options, apart from its spec so that the proposer reads them without
importing the spec (whose builder imports the proposer)."""

from specserve.methods.registry import OptionSpec

# The block size B per request (drafts ≤ B - 1 per step); tiers set it with proposer.block_size.
BLOCK_SIZE = OptionSpec("dflash_block_size", "an integer", tier_setting="block_size")
