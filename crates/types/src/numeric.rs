//! Numeric identifiers: nodes, groups, slots, sequence numbers and the epochs that fence them.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Number of physical hash slots. Fixed for the life of a cluster: keys map to slots with
/// `crc32(key) % HASH_SLOT_COUNT`, and only the slot → group table ever changes.
pub const HASH_SLOT_COUNT: u16 = 256;

/// Declares a `u64`/`u32` newtype with the derives and accessors every id shares.
macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// Wraps a raw value.
            pub const fn new(raw: $inner) -> Self {
                Self(raw)
            }

            /// The raw value.
            pub const fn get(self) -> $inner {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

/// Declares a counter newtype that only moves forward: adds `next()` on top of the id derives.
macro_rules! counter_newtype {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        id_newtype!($(#[$doc])* $name(u64), $prefix);

        impl $name {
            /// The value after this one.
            ///
            /// # Panics
            /// On overflow of `u64`, which 2^64 increments cannot reach in practice.
            #[must_use]
            pub const fn next(self) -> Self {
                match self.0.checked_add(1) {
                    Some(v) => Self(v),
                    None => panic!("counter overflow"),
                }
            }

            /// The value after this one, or `None` at `u64::MAX` (for values read from the wire or the
            /// disk, which may be anything).
            #[must_use]
            pub const fn checked_next(self) -> Option<Self> {
                match self.0.checked_add(1) {
                    Some(v) => Some(Self(v)),
                    None => None,
                }
            }
        }
    };
}

id_newtype!(
    /// A node (process) of the cluster. Zero is never a valid node: raft-rs reserves it for "none".
    NodeId(u64),
    "n"
);
id_newtype!(
    /// A logical slot group: one Raft group that owns some of the physical hash slots.
    GroupId(u32),
    "g"
);
id_newtype!(
    /// One life of a node's data directory: drawn when the directory is first initialized and kept
    /// in it, so a node started again on a new or emptied directory has another. Peers remember the one
    /// they first saw for each node and refuse a node that comes back with another (it lost the votes
    /// and records the cluster counted on). Zero is never drawn.
    StorageId(u64),
    "s"
);
counter_newtype!(
    /// Position of a record in a channel log. The first record has seq 1; seq 0 means "nothing".
    Seq,
    "#"
);
counter_newtype!(
    /// Channel membership epoch: bumped whenever replicas or ISR change, fencing old members.
    Epoch,
    "e"
);
counter_newtype!(
    /// Channel leader epoch: bumped on every leader change; every record carries the one that wrote it.
    LeaderEpoch,
    "le"
);
counter_newtype!(
    /// Revision of a route table snapshot; a new snapshot always has a higher revision.
    RouteRevision,
    "r"
);
counter_newtype!(
    /// Version of the physical slot → group table; bumped by every hash-slot migration.
    HashToSlotVersion,
    "v"
);
counter_newtype!(
    /// Raft term as observed by the router.
    Term,
    "t"
);
counter_newtype!(
    /// Configuration epoch of a slot group: bumped when its assignment of peers changes.
    ConfigEpoch,
    "ce"
);

/// One of the [`HASH_SLOT_COUNT`] physical hash slots. Always in range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct HashSlot(u16);

impl HashSlot {
    /// The slot with this index, or `None` if `index >= HASH_SLOT_COUNT`.
    pub const fn new(index: u16) -> Option<Self> {
        if index < HASH_SLOT_COUNT {
            Some(Self(index))
        } else {
            None
        }
    }

    /// The slot's index, in `0..HASH_SLOT_COUNT`.
    pub const fn index(self) -> u16 {
        self.0
    }

    /// All slots in ascending order.
    pub fn all() -> impl DoubleEndedIterator<Item = HashSlot> + ExactSizeIterator {
        (0..HASH_SLOT_COUNT).map(HashSlot)
    }
}

impl fmt::Display for HashSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot{}", self.0)
    }
}

impl<'de> Deserialize<'de> for HashSlot {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = u16::deserialize(d)?;
        HashSlot::new(raw)
            .ok_or_else(|| serde::de::Error::custom(format_args!("hash slot {raw} out of range 0..{HASH_SLOT_COUNT}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_slot_bounds() {
        assert_eq!(HashSlot::new(0).map(HashSlot::index), Some(0));
        assert_eq!(HashSlot::new(255).map(HashSlot::index), Some(255));
        assert_eq!(HashSlot::new(256), None);
        assert_eq!(HashSlot::all().len(), 256);
    }

    #[test]
    fn hash_slot_decode_rejects_out_of_range() {
        let bytes = postcard::to_allocvec(&300u16).unwrap();
        assert!(postcard::from_bytes::<HashSlot>(&bytes).is_err());
        let bytes = postcard::to_allocvec(&255u16).unwrap();
        assert_eq!(postcard::from_bytes::<HashSlot>(&bytes).unwrap().index(), 255);
    }

    #[test]
    fn counters_advance_and_order() {
        assert_eq!(Seq::new(1).next(), Seq::new(2));
        assert!(LeaderEpoch::new(2) > LeaderEpoch::new(1));
        assert_eq!(NodeId::new(3).to_string(), "n3");
        assert_eq!(GroupId::new(4).get(), 4);
    }
}
