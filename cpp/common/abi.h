// ABI version and signature-table helpers every native module exports (checked by Python at load).
#pragma once

// Bump when a params struct, a dtype code or an entry point's argument list changes.
#define HMOE_ABI_VERSION 1

#define HMOE_STR_(x) #x
#define HMOE_STR(x) HMOE_STR_(x)
