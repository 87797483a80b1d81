"""Committing samples: validation of a dump against what was sent (:mod:`.validate`), the
sample archive in ``torch.save``'s format (:mod:`.archive`), the atomic, durable commit
(:mod:`.committer`) and the CRC-32 both it and ``verify`` use (:mod:`.crc`)."""
