//! Routing of keys to the slot group that owns them, and to that group's current leader.
//!
//! A key maps to a physical [`HashSlot`] by `crc32(key) % 256` ([`hash_slot`]); a versioned
//! [`HashToSlot`] table maps each physical slot to a logical slot group; a [`RouteTable`] is an immutable
//! snapshot of that table plus what was last observed of every group (leader, term, voters, learners,
//! config epoch). A [`Router`] publishes snapshots atomically: readers never block and never see a
//! half-updated table, and one snapshot resolves a whole batch of keys consistently.
//!
//! Resolution fails closed: a slot with no group route, or a group with no known leader, is a typed
//! [`RouteError`], never a guessed node.
//!
//! ```
//! use tidings_router::{GroupObservation, HashToSlot, Router};
//! use tidings_types::{ConfigEpoch, GroupId, NodeId, Term};
//!
//! let router = Router::new(HashToSlot::even_split(4).unwrap());
//! // Nothing is known about the groups yet: no guess.
//! assert!(router.snapshot().resolve(b"user:42").is_err());
//!
//! let route = router.snapshot().hash_to_slot().group_of_key(b"user:42");
//! router
//!     .observe(route, GroupObservation {
//!         leader: Some(NodeId::new(2)),
//!         term: Term::new(5),
//!         voters: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
//!         learners: vec![],
//!         config_epoch: ConfigEpoch::new(1),
//!     })
//!     .unwrap();
//! let resolved = router.snapshot().resolve(b"user:42").unwrap();
//! assert_eq!(resolved.leader, NodeId::new(2));
//! assert_eq!(resolved.group, route);
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod hash_to_slot;
mod route_table;
mod router;

pub use hash_to_slot::{hash_slot, HashToSlot, HashToSlotError};
pub use route_table::{GroupObservation, GroupRoute, Route, RouteError, RouteTable};
pub use router::{ObserveOutcome, Router, UpdateError};

pub use tidings_types::{GroupId, HashSlot, HASH_SLOT_COUNT};
