"""Resource pools (Ray placement groups), worker groups (typed fan-out), and the placement plan."""
