"""Remote prefix caching (the paper's second scenario): a prefix KV store on Redis, a verifier
engine next to it and a drafter engine far from it, speaking gRPC.

codec.py      tensors <-> bytes (JSON header + raw buffers + checksum; no pickle)
chain.py      the hash chain over fixed token blocks (what a key is)
forms.py      a prefix's per-block stored forms: full K/V, and each compressor's compressed K/V
store.py      the Redis store: put / match / get blocks, list and remove prefixes
verifier.py   the verifier role: sessions (full KV from the store + exact prefill), batched verification
client.py     the drafter's side of a verifier session (gRPC bidirectional stream)
fetch.py      the drafter's background fetches from the store (compressed or full KV)
netlab.py     a shaped network on one machine: namespaces, veth pairs, tc, measured links
"""
