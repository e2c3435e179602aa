// The ABI version every native module exports (constants.h's abi_version; checked by Python at load
// with the signature table of signatures.h and the other constants), and stringizing helpers.
#pragma once

#include "hmoe/constants.h"

#define HMOE_ABI_VERSION (::hmoe::k::abi_version)

#define HMOE_STR_(x) #x
#define HMOE_STR(x) HMOE_STR_(x)
