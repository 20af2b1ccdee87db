"""etcd as the job's store: `store.EtcdStore` (a c10d Store on etcd's JSON gateway) and the
node agents' long-lived watch streams (`watch`). Part of the membership layer."""
