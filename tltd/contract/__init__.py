"""What the daemon, its worker processes and the client share below the wire: the typed
messages between the daemon and its workers, a policy broadcast's group, and a model's shape
read from its Hugging Face config. Depends on `tltd.domain` only (torch, where a function
needs it, is imported inside it)."""
