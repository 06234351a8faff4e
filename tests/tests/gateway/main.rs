//! An OpenShell gateway driving `vm-driver serve` on real VMs, through its ComputeDriver service and the
//! supervisor protocol our host supervisors speak to it (`cargo test -p vm-e2e --test gateway`). The
//! gateway is the stand-in of `vm_test_support::openshell` (`docs/openshell.md` says why).
//!
//! - [`openshell`]: create, Ready, exec (as the gateway's russh exec), list, delete; stop, start and
//!   restarts of the driver and the gateway; the main process and its exit; port forwards; what is refused.
//! - [`hostile_gateway`]: a gateway or relay that floods, stalls or presents a token it should not, bounded
//!   and recorded, with no other sandbox touched.
#![expect(clippy::unwrap_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod common;
mod hostile_gateway;
mod openshell;
