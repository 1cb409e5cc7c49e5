"""The KV caches the one generation loop (generation.generate) drives, plugged into model.py's
Transformer, and the registry that makes them by name:

    full.py       the full cache (K, V in the model's dtype or in 16 bits)
    plugged.py    SpeCache (the package specache/) plugged into every layer
    eviction.py   the eviction baselines, StreamingLLM and H2O
    disk_tier.py  SpeCache's slow tier on disk, for CPU-only machines
    stats.py      SpeCache's accounting and diagnostics (a specache.Probe)
    by_name.py    the methods' names, and make_cache, which makes the cache a name names

A cache is an object with these methods (full.FullCache, plugged.PluggedSpeCache and
eviction.EvictionCache; each plugs a module into every layer's `attention.kv_cache`):

    begin(tokens, lengths, held)  a generation of the right-padded prompts starts: per-generation
                                  state is reset (prefill follows, through the model's layers, in
                                  one piece or in chunks); `held` > 0 (caches that `chunks`): each
                                  sequence holds that many tokens already, which the prompts
                                  continue
    ingest(recorded)              instead of prefill: each layer's prompt (K, V, the attention each
                                  key got or None) from a prefill done elsewhere, after `begin`
                                  (scripts/eval/harness.py shares one prefill among caches)
    bootstrap(model, first, pos)  once, before the first step (SpeCache: its first guess and fetch)
    step(model, token, pos)       one decode step of the real tokens (B, 1): their logits (B, 1, V)
    sampled(token)                the real tokens the loop sampled from them
    finish(keep)                  the generation ended (wait for whatever runs in the background);
                                  `keep`: what the cache holds stays for a continuation
    step_bytes(positions)         KV bytes a step reads, the sequences holding `positions` tokens
    stats(steps)                  tier sizes and the cache's own figures, for --json and the tables
    graph_breaks                  whether a compiled step must split its graph
    whole_step                    whether a step is one pass of `model.forward` (compile it whole)
    chunks                        whether prefill may come in chunks, on top of what the cache holds
                                  (`CausalPrompt.start` > 0: --prefill_chunk, a chat's next turn)
"""
