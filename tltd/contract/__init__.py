"""What the daemon, its worker processes and the client share below the wire: the typed
messages between the daemon and its workers, a policy broadcast's group, a model's shape
read from its Hugging Face config, and a sample's token cap and predicted length. Depends on
`tltd.domain` only (torch, where a function needs it, is imported inside it)."""
