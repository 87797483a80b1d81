"""Producers: whatever computes the hidden states and drops one dump per request (:mod:`.base`
is the seam): a Hugging Face model in worker processes (:mod:`.hf`), an SGLang server with the
capture hook (:mod:`.sglang`), or synthetic dumps for sizing disks (:mod:`.synthetic`)."""
