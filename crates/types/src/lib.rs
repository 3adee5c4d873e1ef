//! Identifier newtypes shared by every tidings crate.
//!
//! Parse, don't validate: a value of one of these types is known to be well formed, so code past the
//! boundary never re-checks it. Numeric ids are plain newtypes; [`HashSlot`] and [`ChannelId`] can only be
//! built through checked constructors.
//!
//! ```
//! use tidings_types::{ChannelId, ChannelType, HashSlot, Seq};
//!
//! let slot = HashSlot::new(17).unwrap();
//! assert_eq!(slot.index(), 17);
//! assert!(HashSlot::new(256).is_none());
//!
//! let group_chat = ChannelId::new(ChannelType::GROUP, "room-42").unwrap();
//! assert_eq!(group_chat.id(), "room-42");
//! assert_eq!(Seq::new(7).next(), Seq::new(8));
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod channel;
mod forwards;
mod meta;
mod numeric;
mod rng;
mod time;

pub use channel::{ChannelId, ChannelIdError, ChannelType, CHANNEL_ID_BYTES_MAX};
pub use forwards::TakenForwards;
pub use meta::{ChannelRuntimeMeta, MetaError, WriteFence};
pub use numeric::{
    ConfigEpoch, Epoch, GroupId, HashSlot, HashToSlotVersion, LeaderEpoch, NodeId, RouteRevision, Seq, StorageId, Term,
    HASH_SLOT_COUNT,
};
pub use rng::DetRng;
pub use time::Time;
