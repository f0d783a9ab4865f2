"""Speculative decoding without a draft model: drafts proposed from text a request holds (n-gram
prompt lookup, suffix tries over its tokens and earlier responses), verified by the target model
inside the continuous batch (pure Python here; the verification's sampling lives in
worker/spec_decode.py)."""
