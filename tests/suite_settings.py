"""Settings the suite's caches on the real model share."""

# idle rounds of the same behaviour as the defaults' and a fraction of their model work, so
# that the suite's rounds on the real model stay short: two neighbour pairs per chunk (the
# default is 8), two predicted questions per call (5) and the demo corpus's ten chunks in
# one summary call (3 a call)
SHORT_IDLE = {"knowledge_prefill_neighbours": 2, "prediction_stride": 2, "abstract_batch_chunks": 10}
