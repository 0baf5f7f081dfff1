"""The torch side of the devtools: what must run the exported graph in torch eager."""
